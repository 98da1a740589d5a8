"""agentenv: reinforcement learning of language models on agentic tasks.

Write an :class:`Environment` (or a :class:`SingleTurnEnv`, :class:`MultiTurnEnv`,
:class:`ToolEnv`), test it offline with a :class:`ScriptedModel` (:func:`run` plays it in
one synchronous call), run it at scale with :func:`run_rollouts`. Samples are token-exact:
see :class:`Transcript`. Multi-agent games: a :class:`Game` holds the rules,
:class:`GameEnv` plays it (``agentenv.games``). An agent written against the OpenAI API
trains unchanged through :class:`AgentEnv` (``agentenv.endpoint``).
"""

from agentenv._environment import (
    DEFAULT_ROLE,
    Environment,
    Episode,
    Limits,
    Task,
    resolve_sampling,
)
from agentenv._errors import (
    AgentEnvError,
    ClosedResourceError,
    ConfigError,
    ContextLengthError,
    EpisodeAborted,
    EpisodeTruncated,
    GenerationError,
    HistoryRewriteError,
    IllegalMoveError,
    MessageError,
    ModelNotFoundError,
    OpponentError,
    RewardError,
    SampleError,
    TemplateError,
    ToolCallError,
)
from agentenv._generator import Completion, FinishReason, Generator, SamplingParams
from agentenv._mcp import MCPServer, MCPTool
from agentenv._messages import Message, validate_messages
from agentenv._multiturn import MultiTurnEnv, SingleTurnEnv, ToolEnv
from agentenv._names import resolve_name
from agentenv._policies import load_policy
from agentenv._prompt_data import PromptData, load_prompt_data, read_prompt_data
from agentenv._registry import environment_class, load_environment, register
from agentenv._rewards import Rubric, State, reward
from agentenv._run import RolloutResult, run
from agentenv._runner import (
    JsonlSink,
    ListSink,
    RolloutConfig,
    RolloutStats,
    SampleSink,
    run_rollouts,
)
from agentenv._sample import Sample, Status
from agentenv._scripted import Rule, ScriptedModel
from agentenv._text_model import OpenAIChatModel, TextGenerator
from agentenv._tokenizer import ChatTokenizer, Tokenizer
from agentenv._tools import HermesParser, Tool, ToolCall, ToolCallParser, run_tool_calls, tool
from agentenv._transcript import Transcript
from agentenv.endpoint import AgentEnv
from agentenv.games import (
    Game,
    GameEnv,
    InvalidMove,
    ModelPlayer,
    Player,
    RandomPlayer,
    RoleBaseline,
    StrategyPlayer,
    play_match,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_ROLE",
    "AgentEnv",
    "AgentEnvError",
    "ChatTokenizer",
    "ClosedResourceError",
    "Completion",
    "ConfigError",
    "ContextLengthError",
    "Environment",
    "Episode",
    "EpisodeAborted",
    "EpisodeTruncated",
    "FinishReason",
    "Game",
    "GameEnv",
    "GenerationError",
    "Generator",
    "HermesParser",
    "HistoryRewriteError",
    "IllegalMoveError",
    "InvalidMove",
    "JsonlSink",
    "Limits",
    "ListSink",
    "MCPServer",
    "MCPTool",
    "Message",
    "MessageError",
    "ModelNotFoundError",
    "ModelPlayer",
    "MultiTurnEnv",
    "OpenAIChatModel",
    "OpponentError",
    "Player",
    "PromptData",
    "RandomPlayer",
    "RewardError",
    "RoleBaseline",
    "RolloutConfig",
    "RolloutResult",
    "RolloutStats",
    "Rubric",
    "Rule",
    "Sample",
    "SampleError",
    "SampleSink",
    "SamplingParams",
    "ScriptedModel",
    "SingleTurnEnv",
    "State",
    "Status",
    "StrategyPlayer",
    "Task",
    "TemplateError",
    "TextGenerator",
    "Tokenizer",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolCallParser",
    "ToolEnv",
    "Transcript",
    "environment_class",
    "load_environment",
    "load_policy",
    "load_prompt_data",
    "play_match",
    "read_prompt_data",
    "register",
    "resolve_name",
    "resolve_sampling",
    "reward",
    "run",
    "run_rollouts",
    "run_tool_calls",
    "tool",
    "validate_messages",
]

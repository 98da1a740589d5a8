"""Black-box agents: an OpenAI-compatible endpoint per episode, with token-exact samples.

An agent written against the OpenAI API (the ``openai`` SDK, the OpenAI Agents SDK, any
HTTP client) or Anthropic's Messages API (the ``anthropic`` SDK) is pointed at its
episode's endpoint; each ``POST /v1/chat/completions`` (``POST /v1/responses``, the
Responses API; ``POST /v1/messages``, Anthropic's) generates through the episode's policy
and is recorded into its transcripts as :class:`~agentenv.Transcript` turns (see
:mod:`agentenv.endpoint._recorder` for how calls are matched). :class:`AgentEnv` is the
environment on top: write ``run_agent``, give a rubric. :class:`AgentServer` is the
loopback server itself, for an environment of your own; :func:`chat_routes` serves the
same routes without episodes (``agentenv serve``).
"""

from agentenv.endpoint._anthropic import parse_messages
from agentenv.endpoint._env import AgentEnv
from agentenv.endpoint._protocol import ChatCall, ChatError, ChatReply, parse_chat
from agentenv.endpoint._recorder import EpisodeRecorder
from agentenv.endpoint._responses import parse_responses
from agentenv.endpoint._server import AgentServer, Endpoint, chat_routes, serve_chat

__all__ = [
    "AgentEnv",
    "AgentServer",
    "ChatCall",
    "ChatError",
    "ChatReply",
    "Endpoint",
    "EpisodeRecorder",
    "chat_routes",
    "parse_chat",
    "parse_messages",
    "parse_responses",
    "serve_chat",
]

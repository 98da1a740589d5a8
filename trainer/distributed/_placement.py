"""Placement in slime's terms (docs/distributed.md, "The placement"): one Ray placement
group of one-GPU bundles (one-CPU on CPU) for the trainer ranks and the rollout engines,
where each bundle landed *measured* by a probe scheduled into it, never derived from its
index, in (node id, GPU id) order.

    placement = Placement(actor_num_nodes=2, actor_num_gpus_per_node=4, rollout_num_gpus=4)
    placed = placement.place(ray, timeout=60)      # waits, bounded, for the resources
    placed.trainer                                 # 8 bundles, rank r on placed.trainer[r]
    placed.engines                                 # 4 engines of 1 GPU each
"""

from __future__ import annotations

import dataclasses
from typing import Any

from agentenv import ConfigError

__all__ = ["Bundle", "Placed", "Placement", "PlacementTimeoutError"]


class PlacementTimeoutError(ConfigError):
    """The cluster did not have the placement's resources within the timeout."""


@dataclasses.dataclass(frozen=True, slots=True)
class Bundle:
    """One bundle of the placement group, where it landed (measured inside it)."""

    index: int  # in the placement group (what Ray schedules by)
    node_id: str
    node_ip: str
    gpu_ids: tuple[int, ...]  # the GPUs Ray gave the bundle on its node (empty on CPU)

    @property
    def where(self) -> str:
        """``node 3f2a9c1b (10.0.0.2), GPU 1``: for messages."""
        gpu = f", GPU {','.join(map(str, self.gpu_ids))}" if self.gpu_ids else ""
        return f"node {self.node_id[:8]} ({self.node_ip}){gpu}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """What a run asks of the cluster (slime's flags; see :meth:`from_config`).

    ``gpus``: bundles hold a GPU each (``--device cuda``); else a CPU each, and a rank's
    "GPU" is a CPU process (gloo). ``rollout_num_gpus`` 0: no engines are placed."""

    actor_num_nodes: int = 1
    actor_num_gpus_per_node: int = 1
    rollout_num_gpus: int = 0
    rollout_num_gpus_per_engine: int = 1
    colocate: bool = False
    gpus: bool = True

    def __post_init__(self) -> None:
        if self.rollout_num_gpus % self.rollout_num_gpus_per_engine:
            raise ConfigError(
                f"--rollout-num-gpus {self.rollout_num_gpus} is not a multiple of "
                f"--rollout-num-gpus-per-engine {self.rollout_num_gpus_per_engine}"
            )

    @classmethod
    def from_config(cls, config: Any) -> Placement:
        """The placement of a run's :class:`~trainer.TrainConfig` (``--colocate`` without
        ``--rollout-num-gpus``: engines on every trainer GPU, as slime does). (Typed
        ``Any``: the config's module imports megatron's, which imports this one.)"""
        p = config.placement
        rollout = p.rollout_num_gpus
        if rollout is None:
            rollout = config.trainer_ranks if p.colocate else 0
        return cls(
            actor_num_nodes=p.actor_num_nodes,
            actor_num_gpus_per_node=config.parallel.actor_num_gpus_per_node,
            rollout_num_gpus=rollout,
            rollout_num_gpus_per_engine=config.engine.rollout_num_gpus_per_engine,
            colocate=p.colocate,
            gpus=config.model.device.startswith("cuda"),
        )

    @property
    def actor_gpus(self) -> int:
        """Trainer ranks: ``--actor-num-nodes × --actor-num-gpus-per-node``."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def num_bundles(self) -> int:
        if self.colocate:
            return max(self.actor_gpus, self.rollout_num_gpus)
        return self.actor_gpus + self.rollout_num_gpus

    @property
    def bundle(self) -> dict[str, float]:
        """One bundle's resources."""
        return {"GPU": 1.0, "CPU": 1.0} if self.gpus else {"CPU": 1.0}

    @property
    def share(self) -> float:
        """The fraction of a bundle an actor asks for: all of it, or, colocated, part
        (the trainer rank and the engine on one GPU)."""
        return 0.5 if self.colocate else 1.0

    def describe(self) -> str:
        """``8 bundles of {GPU: 1, CPU: 1} (2 nodes x 4 trainer GPUs + 4 engine GPUs,
        disaggregated)``."""
        unit = "GPUs" if self.gpus else "CPU ranks"
        how = "colocated" if self.colocate else "disaggregated"
        res = ", ".join(f"{k}: {v:g}" for k, v in self.bundle.items())
        return (
            f"{self.num_bundles} bundles of {{{res}}} ({self.actor_num_nodes} node(s) x "
            f"{self.actor_num_gpus_per_node} trainer {unit} + {self.rollout_num_gpus} engine "
            f"{unit}, {how})"
        )

    def place(self, ray: Any, *, timeout: float = 120.0) -> Placed:
        """Reserve the bundles (waiting at most ``timeout`` seconds; then
        :class:`PlacementTimeoutError` with what was asked and what the cluster has),
        measure where each landed and deal them to the trainer and the engines."""
        from ray.util.placement_group import placement_group, remove_placement_group

        group = placement_group([self.bundle] * self.num_bundles, strategy="PACK")
        if not group.wait(timeout_seconds=timeout):
            remove_placement_group(group)
            total = ", ".join(f"{k} {v * self.num_bundles:g}" for k, v in self.bundle.items())
            raise PlacementTimeoutError(
                f"the placement was not ready after {timeout:g} s: asked for "
                f"{self.describe()}, {total} in all; the "
                f"cluster has {_cluster(ray)}. Add nodes (ray start --address HEAD), ask for "
                "fewer GPUs, or wait longer (--placement-timeout)"
            )
        try:
            bundles = _measure(ray, group, self, timeout)
        except BaseException:
            remove_placement_group(group)
            raise
        return Placed(self, group, bundles)


@dataclasses.dataclass(frozen=True, slots=True)
class Placed:
    """A reserved placement: the group, its bundles in (node id, GPU id) order, and
    which the trainer ranks and the engines take."""

    placement: Placement
    group: Any  # ray's PlacementGroup
    bundles: tuple[Bundle, ...]

    @property
    def trainer(self) -> tuple[Bundle, ...]:
        """Trainer rank r's bundle is ``trainer[r]``."""
        return self.bundles[: self.placement.actor_gpus]

    @property
    def engines(self) -> tuple[tuple[Bundle, ...], ...]:
        """Each engine's bundles (``--rollout-num-gpus-per-engine`` of them, on one node)."""
        p = self.placement
        first = 0 if p.colocate else p.actor_gpus
        mine = self.bundles[first : first + p.rollout_num_gpus]
        k = p.rollout_num_gpus_per_engine
        return tuple(mine[i : i + k] for i in range(0, len(mine), k))

    def scheduling(self, bundle: Bundle) -> Any:
        """Ray's scheduling strategy for an actor in ``bundle``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=bundle.index
        )

    def actor_options(self, bundle: Bundle) -> dict[str, Any]:
        """``.options(...)`` for an actor in ``bundle``: its share of the bundle."""
        p = self.placement
        options: dict[str, Any] = {
            "scheduling_strategy": self.scheduling(bundle),
            "num_cpus": p.share,
        }
        if p.gpus:
            options["num_gpus"] = p.share
        return options

    def release(self) -> None:
        """Give the bundles back (the actors in them end)."""
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def _where() -> tuple[str, str, tuple[int, ...]]:
    """Inside a bundle: its node and GPUs, as Ray assigned them."""
    import ray

    from trainer.distributed._cluster import node_address

    gpus = tuple(sorted(int(g) for g in ray.get_gpu_ids()))
    return ray.get_runtime_context().get_node_id(), node_address(), gpus


def _measure(ray: Any, group: Any, placement: Placement, timeout: float) -> tuple[Bundle, ...]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe = ray.remote(_where)
    refs = [
        probe.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, i),
            num_cpus=placement.bundle["CPU"],
            num_gpus=placement.bundle.get("GPU", 0),
        ).remote()
        for i in range(placement.num_bundles)
    ]
    found = ray.get(refs, timeout=timeout)
    bundles = [Bundle(i, node, ip, gpus) for i, (node, ip, gpus) in enumerate(found)]
    bundles.sort(key=lambda b: (b.node_id, b.gpu_ids, b.index))
    out = tuple(bundles)
    k = placement.rollout_num_gpus_per_engine
    first = 0 if placement.colocate else placement.actor_gpus
    engines = out[first : first + placement.rollout_num_gpus]
    for i in range(0, len(engines), k):
        nodes = {b.node_id for b in engines[i : i + k]}
        if len(nodes) > 1:
            raise ConfigError(
                f"engine {i // k}'s {k} GPUs landed on {len(nodes)} nodes "
                f"({', '.join(b.where for b in engines[i : i + k])}); an engine's GPUs must "
                "be on one node: make --rollout-num-gpus-per-engine divide the GPUs per node"
            )
    return out


def _cluster(ray: Any) -> str:
    """What the cluster has, in all and per node: ``GPU 4 (4 free), CPU 8 (6 free) on 1
    node: 3f2a9c1b (10.0.0.2) GPU 4, CPU 8``."""
    total, free = ray.cluster_resources(), ray.available_resources()
    parts = [f"{k} {total.get(k, 0):g} ({free.get(k, 0):g} free)" for k in ("GPU", "CPU")]
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    each = "; ".join(
        f"{n['NodeID'][:8]} ({n['NodeManagerAddress']}) GPU {n['Resources'].get('GPU', 0):g}, "
        f"CPU {n['Resources'].get('CPU', 0):g}"
        for n in nodes
    )
    return f"{', '.join(parts)} on {len(nodes)} node(s): {each}"

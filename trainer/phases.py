"""Where a worker's weights and optimizer state live, phase by phase, and the device memory
around them (verl's hybrid-engine offload, written for FSDP2 and a plain module alike).

- **Offload as phases.** With ``fsdp_config.param_offload`` the parameters live in host memory
  between phases and move to the compute device for the phase that needs them (log-probs,
  update, checkpoint), then back once: verl's ``load_fsdp_model_to_gpu`` /
  ``offload_fsdp_model_to_cpu``, which for FSDP2 are ``model.to(device)`` (FSDP2 re-registers its
  sharded DTensors on the new device). With ``optimizer_offload`` the Adam moments move in for the
  update and out after it, once per step however many mini-batches the update has (verl's
  ``load_fsdp_optimizer`` / ``offload_fsdp_optimizer`` around ``update_actor``). FSDP2's
  ``CPUOffloadPolicy`` is not used: under it the shards are CPU DTensors, and the collectives
  that read them outside FSDP's own forward/backward (``full_tensor()`` in the weight sync and
  the HF export, the norm in ``clip_grad_norm_``) would run on an NCCL-only group with CPU
  tensors ("No backend type associated with device type cpu").
- **Collectives on device tensors only.** :meth:`Phases.require_resident` is called by every
  path that runs a collective on the parameters; the weight sync streams each shard to the device
  before gathering it (:func:`trainer.parallel.weight_buckets` with ``device``), as verl's
  ``rollout_mode`` does (``param.to(device).full_tensor()``).
- **Device memory.** :class:`DeviceMemory` is the one seam on the device-memory API
  (``empty_cache``, ``memory_allocated``/``reserved`` and their peaks); on the CPU it does
  nothing and reads zeros. :meth:`Phases.track` notes the peak of each phase, reported in verl's
  names (``perf/max_memory_allocated_gb``, ``perf/max_memory_reserved_gb``: the step's peak) and
  per phase as ``perf/memory/<phase>/max_allocated_gb`` and ``.../max_reserved_gb``.

On the CPU the compute device and the host are the same, so the moves change no storage, but
they run, and every move is logged (:attr:`Phases.moves`) so that tests can check what moved
when; the residency rules are checked on the CPU exactly as on a GPU.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["GIB", "DeviceMemory", "Move", "Phases", "move_model", "move_optimizer"]

GIB = 1024**3
HOST = torch.device("cpu")


class DeviceMemory:
    """The device-memory API of one device (torch's CUDA API, which ROCm builds of torch speak
    too). On the CPU every call is a no-op and every figure is 0. The one seam tests replace."""

    def __init__(self, device: torch.device) -> None:
        # GPU-only by design, as verl's `get_torch_device()` (torch.cuda, or torch.npu on Ascend,
        # which hpcrl does not target): ROCm builds of torch expose the same `torch.cuda` API, and
        # the CPU has no caching allocator to empty nor device memory to read. Not run here
        # without a GPU; `bench/gpu_check.py` is the check for the day one is lent.
        self.device = device
        self.accelerator = device.type == "cuda"

    def empty_cache(self) -> None:
        """Return the caching allocator's free blocks to the device (verl's
        ``aggressive_empty_cache``: collect garbage, synchronize, empty the cache)."""
        gc.collect()
        if self.accelerator:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device)) if self.accelerator else 0

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device)) if self.accelerator else 0

    def max_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device)) if self.accelerator else 0

    def max_reserved(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device)) if self.accelerator else 0

    def reset_peak(self) -> None:
        if self.accelerator:
            torch.cuda.reset_peak_memory_stats(self.device)


@torch.no_grad()
def move_model(model: torch.nn.Module, device: torch.device) -> None:
    """Every parameter, gradient and buffer of `model` onto `device` (FSDP2: the local shards,
    still DTensors; verl's ``load_fsdp2_model_to_gpu`` / ``offload_fsdp2_model_to_cpu``)."""
    model.to(device)


@torch.no_grad()
def move_optimizer(optim: torch.optim.Optimizer, device: torch.device) -> int:
    """Every tensor of the optimizer's state (Adam's moments, its step) onto `device`; returns
    how many tensors it moved (verl's ``load_fsdp_optimizer`` / ``offload_fsdp_optimizer``)."""
    moved = 0
    for state in optim.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)
                moved += 1
    return moved


@dataclass(frozen=True)
class Move:
    """One move of :class:`Phases`: during `phase`, `what` (`params`/`optimizer`) went `to`
    the compute `device` or the `host`."""

    phase: str
    what: str
    to: str


class Phases:
    """The residency of one worker's models and optimizer, and the memory of each phase.

    Each model is registered with its `param_offload` (:meth:`register`: its parameters live in
    host memory between phases when true, on the compute device otherwise);
    `offload_optimizer`: the optimizer state likewise."""

    def __init__(self, device: torch.device, *, offload_optimizer: bool,
                 memory: DeviceMemory | None = None) -> None:
        self.device = device
        self.offload_optimizer = offload_optimizer
        self.memory = memory or DeviceMemory(device)
        self.moves: list[Move] = []
        self.peaks: dict[str, tuple[int, int]] = {}
        self._offload: dict[int, bool] = {}
        self._resident: dict[int, bool] = {}
        self._current: str | None = None

    def register(self, model: torch.nn.Module, *, offload_params: bool) -> None:
        """Say where `model`'s parameters live between phases (it is on the device now)."""
        self._offload[id(model)] = offload_params
        self._resident[id(model)] = True

    def offloads(self, model: torch.nn.Module) -> bool:
        return self._offload.get(id(model), False)

    # ------------------------------------------------------------------ residency

    def home(self, model: torch.nn.Module, optim: torch.optim.Optimizer | None = None) -> None:
        """Send `model` (and `optim`'s state) to where they live between phases: once after the
        build, and at the end of every phase."""
        phase, offload = self._current or "build", self.offloads(model)
        if offload and self._resident.get(id(model), True):
            move_model(model, HOST)
            self.moves.append(Move(phase, "params", "host"))
        self._resident[id(model)] = not offload
        moved_optim = optim is not None and self.offload_optimizer and move_optimizer(optim, HOST) > 0
        if moved_optim:
            self.moves.append(Move(phase, "optimizer", "host"))
        if offload or moved_optim:  # synchronizes first: the non-blocking copies have landed
            self.memory.empty_cache()

    def _load(self, model: torch.nn.Module, optim: torch.optim.Optimizer | None, phase: str) -> None:
        if not self._resident.get(id(model), True):
            move_model(model, self.device)
            self.moves.append(Move(phase, "params", "device"))
        self._resident[id(model)] = True
        if optim is not None and self.offload_optimizer and move_optimizer(optim, self.device):
            self.moves.append(Move(phase, "optimizer", "device"))

    def require_resident(self, model: torch.nn.Module, what: str) -> None:
        """Refuse a collective on `model`'s parameters while they are offloaded to the host
        (NCCL has no CPU backend), and check every parameter is on the compute device."""
        if not self._resident.get(id(model), True):
            raise RuntimeError(f"{what} needs the parameters on `{self.device}`, but they are "
                               "offloaded to the host; run it inside `Phases.on_device`")
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.device.type != self.device.type:
                raise RuntimeError(f"{what}: parameter `{name}` is on `{local.device}`, not on the "
                                   f"compute device `{self.device}`")

    @contextmanager
    def on_device(self, phase: str, model: torch.nn.Module, optim: torch.optim.Optimizer | None = None
                  ) -> Iterator[None]:
        """Run `phase` with `model` (and `optim`'s state) on the compute device, then send them
        home (a no-op where nothing is offloaded); the phase's peak memory is noted."""
        with self.track(phase):
            self._load(model, optim, phase)
            try:
                yield
            finally:
                self.home(model, optim)

    # ------------------------------------------------------------------ memory

    @contextmanager
    def track(self, phase: str) -> Iterator[None]:
        """Note the peak allocated and reserved device memory during `phase`."""
        outer, self._current = self._current, phase
        if outer is None:
            self.memory.reset_peak()
        try:
            yield
        finally:
            self._current = outer
            peak = (self.memory.max_allocated(), self.memory.max_reserved())
            old = self.peaks.get(phase, (0, 0))
            self.peaks[phase] = (max(old[0], peak[0]), max(old[1], peak[1]))

    def metrics(self) -> dict[str, float]:
        """The peaks since the last call, in GiB (verl's names for the largest), then forgotten."""
        out: dict[str, float] = {}
        for phase, (alloc, reserved) in self.peaks.items():
            out[f"perf/memory/{phase}/max_allocated_gb"] = alloc / GIB
            out[f"perf/memory/{phase}/max_reserved_gb"] = reserved / GIB
        out["perf/max_memory_allocated_gb"] = max((a for a, _ in self.peaks.values()), default=0) / GIB
        out["perf/max_memory_reserved_gb"] = max((r for _, r in self.peaks.values()), default=0) / GIB
        self.peaks.clear()
        return out


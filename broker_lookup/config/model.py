"""What a valid configuration is: :class:`LookupConfig` and :class:`LookupMetadata`.

Field names follow LMCache's ``LMCacheEngineConfig`` where LMCache has them, so a
deployment can move its settings over unchanged. Every value is checked when the
object is built; a bad one raises :class:`~broker_lookup.errors.ConfigError`
naming the field, the value (secrets redacted) and where it came from: the flag, the
file, the LMCache config or the environment variable (built directly, its variable).
Where values come from, and in which order, is :mod:`broker_lookup.config.sources`:
the ``from_*`` constructors and :meth:`LookupConfig.load` here are its functions.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from broker_lookup.config.env import env_credentials, env_name, env_origin
from broker_lookup.config.urls import given_credentials, redact_url, url_problem
from broker_lookup.errors import ConfigError
from broker_lookup.protocol.keys import validate_configured_id, validate_engine_id

if TYPE_CHECKING:
    from broker_lookup.config import sources

__all__ = [
    "ENGINE_TTL_MAX_MS",
    "DeadlineRule",
    "LookupConfig",
    "LookupMetadata",
    "expected_ranks",
]


#: Fields that must be > 0.
_POSITIVE = (
    "chunk_size lookup_timeout_ms socket_timeout_ms block_ms heartbeat_interval_ms "
    "heartbeat_ttl_ms stream_maxlen done_maxlen dead_maxlen max_pending "
    "max_lookup_id_length max_chunks_per_request max_request_configs_bytes worker_pin_ttl_ms "
    "worker_dedupe_capacity redis_retries breaker_open_ms worker_watchdog_grace_ms "
    "partial_answer_wait_ms engine_ttl_ms"
).split()
#: The longest an engine's keys may outlive its last process (``engine_ttl_ms``).
ENGINE_TTL_MAX_MS = 3_600_000
#: True while a loader that read the environment itself builds a config: the
#: credentials it did not find there are not looked up again in ``os.environ``.
_ENV_READ: ContextVar[bool] = ContextVar("_ENV_READ", default=False)


@contextmanager
def environment_read() -> Iterator[None]:
    """Within it, configs are built from values a loader already read from the environment."""
    token = _ENV_READ.set(True)
    try:
        yield
    finally:
        _ENV_READ.reset(token)


#: The fewest heartbeat intervals a heartbeat TTL and an owner lease may span: one late
#: beat (a slow round trip, a GC pause) must not make a live process look dead.
LIVENESS_BEATS = 3


class DeadlineRule(NamedTuple):
    """A lookup's deadline in ms after its submit: ``base_ms`` plus ``per_1k_ms`` per 1,000
    prompt tokens, at most ``ceiling_ms`` (``LookupConfig.deadline_rule`` builds it)."""

    base_ms: int
    per_1k_ms: int
    ceiling_ms: int

    def budget_ms(self, tokens: int) -> int:
        """The deadline of a prompt of ``tokens`` tokens."""
        return min(self.base_ms + self.per_1k_ms * tokens // 1000, self.ceiling_ms)


class _Validated(msgspec.Struct, frozen=True, kw_only=True):
    """Base that type-checks every field at construction (msgspec does not on ``__init__``)."""

    def __post_init__(self) -> None:
        for info in msgspec.structs.fields(self):
            value = getattr(self, info.name)
            try:
                msgspec.convert(value, info.type, strict=True)
            except msgspec.ValidationError as exc:
                raise _bad(
                    info.name, _shown(info.name, value), f"has the wrong type: {exc}"
                ) from None
        self._check()

    def _check(self) -> None:
        """Cross-field and range checks of the subclass."""


def _shown(field: str, value: object) -> str:
    if "password" in field and value is not None:
        return "'***'"
    if isinstance(value, str):
        return repr(redact_url(value))
    return repr(value)


def _require(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:
        raise _bad(field, _shown(field, value), f"is invalid: {rule}")


def _require_pair(
    ok: bool, field: str, value: object, other: str, other_value: object, rule: str
) -> None:
    """Refuse a combination of two fields: the error names both values and their sources."""
    if not ok:
        raise _bad(field, _shown(field, value), rule, other=(other, _shown(other, other_value)))


def _bad(
    field: str,
    shown: str,
    problem: str,
    origin: str | None = None,
    *,
    other: tuple[str, str] | None = None,
    other_origin: str | None = None,
) -> ConfigError:
    """The error of ``field``'s value: ``origin`` is where it came from; unknown (the
    object was built directly), the variable that would set it. ``other``: the (field,
    shown value) that ``field``'s value can't go with, from ``other_origin``."""
    where = origin or env_origin(field)
    if other is None:
        return ConfigError(
            f"{field}={shown} ({where}) {problem}", field=field, shown=shown, problem=problem
        )
    name, other_shown = other
    there = other_origin or env_origin(name)
    return ConfigError(
        f"{field}={shown} ({where}) does not go with {name}={other_shown} ({there}): {problem}",
        field=field,
        shown=shown,
        problem=problem,
        other=name,
        other_shown=other_shown,
    )


class LookupConfig(_Validated, frozen=True, kw_only=True):
    """Everything the client and the workers can be told, with LMCache's names and defaults.

    >>> cfg = LookupConfig(redis_url="redis://localhost:6379/0", lookup_timeout_ms=1500)
    >>> cfg.chunk_size
    256
    """

    # LMCache's names (LMCacheEngineConfig).
    chunk_size: int = 256  #: tokens per chunk
    save_unfull_chunk: bool = False  #: hash the trailing partial chunk too
    #: a lookup not answered by its deadline returns 0 (terminal); this is the deadline's
    #: base, which ``lookup_timeout_per_1k_tokens_ms`` scales with the prompt
    lookup_timeout_ms: int = 3000
    lookup_server_worker_ids: tuple[int, ...] | None = None  #: ranks asked; None = LMCache's rule
    enable_async_loading: bool = False  #: factory: async client instead of the sync one
    enable_scheduler_bypass_lookup: bool = False  #: factory: scheduler asks its own engine
    external_lookup_client: str | None = None  #: factory: ``<scheme>://<address>``
    hit_miss_ratio: float | None = None  #: cap hits at (1 - ratio) of the prompt, for benchmarks
    enable_chunk_statistics: bool = False  #: count total and unique chunks seen
    pre_caching_hash_algorithm: str = "builtin"  #: chunk hash function (LMCache's setting)
    # The broker's own knobs.
    redis_url: str = "redis://127.0.0.1:6379/0"  #: see config.urls.Scheme for schemes
    redis_username: str | None = None  #: ACL user; overrides the URL's
    redis_password: str | None = None  #: overrides the URL's; never logged
    ssl_ca_certs: str | None = None  #: CA bundle for rediss://
    ssl_certfile: str | None = None  #: client certificate for mutual TLS
    ssl_keyfile: str | None = None  #: client key for mutual TLS
    socket_timeout_ms: int = 5000  #: every Redis socket read/write
    block_ms: int = 200  #: XREAD/XREADGROUP BLOCK; well under socket_timeout_ms
    heartbeat_interval_ms: int = 500  #: how often a rank refreshes its heartbeat
    heartbeat_ttl_ms: int = 2000  #: a rank silent this long is dead
    #: the lease of a rank's or a scheduler's role (one owner each): a holder renews it
    #: every heartbeat_interval_ms; a second process takes over once it is this long
    #: unrenewed. None: heartbeat_ttl_ms
    owner_lease_ms: int | None = None
    #: approximate cap of the request stream, in entries (a batch entry counts one; a
    #: batch also trims the entries older than the longest lookup hash's TTL)
    stream_maxlen: int = 20000
    #: approximate cap of the completion stream, in completions (an entry counts its own)
    done_maxlen: int = 20000
    dead_maxlen: int = 1000  #: approximate cap of the dead-letter stream
    key_grace_ms: int = 10000  #: a lookup hash lives lookup_timeout_ms + this
    #: every key of an engine expires at most this long after its last process stopped
    #: or died; each live process refreshes the engine's streams and fingerprint hash
    #: with it (at most 1 h, longer than heartbeat_ttl_ms and every lookup hash's TTL)
    engine_ttl_ms: int = 600_000
    max_pending: int = 100_000  #: lookups the client tracks at once; beyond, lookups answer 0
    #: ``lookup()`` writes its submit itself where it can without waiting (a plain TCP or
    #: unix connection, nothing queued, not a burst): one thread wake-up less per lookup,
    #: a socket write more inside ``lookup()``. False: every submit goes through the
    #: sender thread's queue
    submit_on_caller_thread: bool = True
    #: finished lookups never cleared answer -1 after this; with lookup_timeout_ms it
    #: must fit in worker_pin_ttl_ms, so no result outlives the pins it promises. None:
    #: 30 s, or less where the pin TTL asks for it (see ``retention_ms``)
    result_retention_ms: int | None = None
    max_lookup_id_length: int = 4096  #: characters; a longer id is answered 0
    #: a Redis call outstanding this long, or one that failed, opens the circuit breaker:
    #: new lookups answer 0 at once until Redis answers again
    breaker_open_ms: int = 1000
    #: a rank whose engine has not reported by the lookup's deadline plus this reports 0
    #: for it and releases its memory (an engine that never answers, LMCache D9)
    worker_watchdog_grace_ms: int = 2000
    max_chunks_per_request: int = 16384  #: 4M tokens at chunk 256
    max_request_configs_bytes: int = 8192  #: encoded size of request_configs
    worker_pin_ttl_ms: int = 60000  #: a worker releases a completed lookup's pins after this
    worker_dedupe_capacity: int = 100_000  #: (id, gen) pairs a worker remembers
    redis_retries: int = 3  #: attempts for one write before it counts as failed
    #: added to a lookup's deadline per 1,000 prompt tokens (SGLang HiCache's base +
    #: per-1k rule): a 128k-token prompt may load for longer than a 1k one. 0: a flat
    #: deadline, as LMCache's
    lookup_timeout_per_1k_tokens_ms: int = 10
    #: ceiling of the scaled deadline. None: ``min(4 x lookup_timeout_ms, (lookup_timeout_ms
    #: + worker_pin_ttl_ms) / 2)``, so the longest deadline always fits in the pin TTL
    lookup_timeout_max_ms: int | None = None
    #: per-rank report latency, last-to-report and hit divergence (the report script
    #: stamps each rank's report on the server's clock); False: none of it is recorded
    rank_insights: bool = True
    #: at most this many lookups a second are timed; each timed one counts for the
    #: untimed ones since the one before it, so the figures estimate every lookup (0:
    #: time every lookup). Bounds what insights cost a saturated engine
    rank_insights_max_per_s: float = 200.0
    #: a WARNING (rate-limited) names a lookup whose ranks' hits differ by more than
    #: this share of its prompt tokens
    rank_spread_warn_share: float = 0.5
    #: at the deadline, answer the prefix every expected rank confirmed loaded and
    #: pinned (engines that report progress) instead of 0; ranks keep exactly that
    #: prefix pinned. Off by default: a timeout answers 0 at the deadline at once,
    #: and this waits up to ``partial_answer_wait_ms`` for one more round trip
    partial_answers: bool = False
    #: how long past its deadline a lookup may wait for the partial answer before it
    #: answers 0 (the deciding round trip failed or is stalled)
    partial_answer_wait_ms: int = 250
    #: how often the scheduler and each rank publish their counters and histograms to
    #: Redis (``bl:{E}:metrics:<role>``, with the lease's renewal), for ``broker-lookup
    #: exporter``; each snapshot expires after 3 intervals (at most engine_ttl_ms, a
    #: shorter one publishes more often). At least heartbeat_interval_ms; 0: publish nothing
    metrics_interval_ms: int = 5000

    def __post_init__(self) -> None:
        if not _ENV_READ.get() and isinstance(self.redis_url, str):
            # A secret belongs in the environment however the rest is given: built from
            # keywords or a file, a config without credentials takes the variables' (the
            # ones an authentication error names), as the loaders do.
            url_user, url_password = given_credentials(self.redis_url)
            found = env_credentials(
                url_user, url_password, self.redis_username, self.redis_password
            )
            for field, value in found.items():
                msgspec.structs.force_setattr(self, field, value)
        super().__post_init__()

    def __repr__(self) -> str:
        shown = ", ".join(f"{f}={_shown(f, getattr(self, f))}" for f in self.__struct_fields__)
        return f"LookupConfig({shown})"

    __str__ = __repr__

    def _check(self) -> None:
        for name in _POSITIVE:
            value = getattr(self, name)
            _require(value > 0, name, value, "must be > 0")
        _require(self.key_grace_ms >= 0, "key_grace_ms", self.key_grace_ms, "must be >= 0")
        problem = url_problem(self.redis_url)
        _require(problem is None, "redis_url", self.redis_url, problem or "")
        self._check_liveness()
        _require(
            self.worker_pin_ttl_ms > self.lookup_timeout_ms,
            "worker_pin_ttl_ms",
            self.worker_pin_ttl_ms,
            f"must exceed lookup_timeout_ms={self.lookup_timeout_ms} "
            "(pins must outlive the lookup)",
        )
        per_1k = self.lookup_timeout_per_1k_tokens_ms
        _require(per_1k >= 0, "lookup_timeout_per_1k_tokens_ms", per_1k, "must be >= 0")
        ceiling = self.lookup_timeout_max_ms
        _require(
            ceiling is None
            or self.lookup_timeout_ms <= ceiling < self.worker_pin_ttl_ms - self.wait_ms,
            "lookup_timeout_max_ms",
            ceiling,
            f"must be at least lookup_timeout_ms={self.lookup_timeout_ms} and, plus "
            f"partial_answer_wait_ms when partial_answers is on, under "
            f"worker_pin_ttl_ms={self.worker_pin_ttl_ms} (pins must outlive every lookup)",
        )
        longest = self.longest_timeout_ms
        _require(
            self.worker_pin_ttl_ms > longest,
            "worker_pin_ttl_ms",
            self.worker_pin_ttl_ms,
            f"must exceed the longest deadline ({longest} ms, partial_answer_wait_ms "
            "included when partial_answers is on): pins must outlive every lookup",
        )
        retention = self.result_retention_ms
        _require(
            retention is None or 0 < retention <= self.worker_pin_ttl_ms - longest,
            "result_retention_ms",
            retention,
            f"must be > 0 and, plus the longest deadline ({longest} ms: see "
            f"lookup_timeout_max_ms), not exceed worker_pin_ttl_ms={self.worker_pin_ttl_ms} "
            "(a result must not outlive its pins)",
        )
        rate = self.rank_insights_max_per_s
        _require(
            math.isfinite(rate) and rate >= 0.0,
            "rank_insights_max_per_s",
            rate,
            "must be a finite number >= 0 (0: time every lookup)",
        )
        share = self.rank_spread_warn_share
        _require(0.0 < share <= 1.0, "rank_spread_warn_share", share, "must be > 0 and at most 1")
        ratio = self.hit_miss_ratio
        _require(
            ratio is None or 0.0 <= ratio <= 1.0, "hit_miss_ratio", ratio, "must be between 0 and 1"
        )
        ids = self.lookup_server_worker_ids
        _require(
            ids is None or all(i >= 0 for i in ids),
            "lookup_server_worker_ids",
            ids,
            "ranks are >= 0",
        )
        self._check_engine_ttl()
        every = self.metrics_interval_ms
        _require(
            every == 0 or every >= self.heartbeat_interval_ms,
            "metrics_interval_ms",
            every,
            f"must be 0 (off) or at least heartbeat_interval_ms={self.heartbeat_interval_ms} "
            "(a snapshot goes with a heartbeat)",
        )

    def _check_liveness(self) -> None:
        """Refuse timers that cannot keep a lease or a heartbeat alive: each error names
        both values and where each came from."""
        interval = self.heartbeat_interval_ms
        _require_pair(
            self.block_ms + 1000 <= self.socket_timeout_ms,
            "block_ms",
            self.block_ms,
            "socket_timeout_ms",
            self.socket_timeout_ms,
            "block_ms must be at least 1000 ms under socket_timeout_ms (a blocking read "
            "longer than the socket timeout fails, and the connection with it)",
        )
        _require_pair(
            self.block_ms < self.heartbeat_ttl_ms,
            "block_ms",
            self.block_ms,
            "heartbeat_ttl_ms",
            self.heartbeat_ttl_ms,
            "block_ms must be under heartbeat_ttl_ms (a loop blocked in one read longer "
            "than a heartbeat lives sees its ranks die between two reads)",
        )
        _require_pair(
            self.heartbeat_ttl_ms >= LIVENESS_BEATS * interval,
            "heartbeat_ttl_ms",
            self.heartbeat_ttl_ms,
            "heartbeat_interval_ms",
            interval,
            f"heartbeat_ttl_ms must be at least {LIVENESS_BEATS} times heartbeat_interval_ms "
            "(one late beat must not make a live rank look dead)",
        )
        _require_pair(
            self.lease_ms >= LIVENESS_BEATS * interval,
            "owner_lease_ms",
            self.lease_ms,
            "heartbeat_interval_ms",
            interval,
            f"the owner lease must be at least {LIVENESS_BEATS} times heartbeat_interval_ms "
            "(a holder renews it every interval; one late renewal must not lapse it)",
        )

    def _check_engine_ttl(self) -> None:
        ttl = self.engine_ttl_ms
        floor = max(self.heartbeat_ttl_ms, self.lease_ms, self.key_ttl_ms)
        _require(
            floor < ttl <= ENGINE_TTL_MAX_MS,
            "engine_ttl_ms",
            ttl,
            f"must exceed heartbeat_ttl_ms={self.heartbeat_ttl_ms}, the owner lease "
            f"({self.lease_ms} ms) and the longest lookup hash TTL ({self.key_ttl_ms} ms: the "
            "longest deadline plus key_grace_ms), and be "
            f"at most {ENGINE_TTL_MAX_MS} (1 h): no key of an engine may outlive it longer",
        )

    @property
    def lease_ms(self) -> int:
        """The lease of one role: ``owner_lease_ms``, or ``heartbeat_ttl_ms`` by default."""
        return self.owner_lease_ms if self.owner_lease_ms is not None else self.heartbeat_ttl_ms

    @property
    def loop_timeout_s(self) -> float:
        """Socket timeout, in seconds, of every connection a blocking-read loop uses (the
        client's listener, each rank's connections): BLOCK plus ``breaker_open_ms``. It
        bounds how long a stalled Redis can pause one of those loops (their timeout
        sweeps, heartbeats and watchdog run on after it, never after the general
        ``socket_timeout_ms``), and so how long ``close()`` waits for such a loop to end."""
        return (self.block_ms + self.breaker_open_ms) / 1000

    @property
    def beat_timeout_s(self) -> float:
        """Socket timeout, in seconds, of a process's beat (lease, heartbeat, refreshes):
        a loop's (:attr:`loop_timeout_s`) but at most half a lease, so a renewal waiting
        on a stalled server costs one beat, never the lease it renews."""
        return min(self.loop_timeout_s, self.lease_ms / 2000)

    @property
    def metrics_ttl_ms(self) -> int:
        """PX of a published metrics snapshot: 3 intervals, so a late publish never
        blinks a live process's series out and a gone process's vanish soon; at most
        ``engine_ttl_ms`` (no key outlives its engine)."""
        return min(3 * self.metrics_interval_ms, self.engine_ttl_ms)

    @property
    def metrics_period_ms(self) -> int:
        """How often a snapshot is written: ``metrics_interval_ms``, or often enough for 3
        within ``metrics_ttl_ms`` where ``engine_ttl_ms`` cut it (never more often than
        the heartbeat, which ``engine_ttl_ms`` exceeds twice over); 0: never."""
        every = self.metrics_interval_ms
        if not every:
            return 0
        return max(self.heartbeat_interval_ms, min(every, self.metrics_ttl_ms // 3))

    @property
    def epochs_ttl_ms(self) -> int:
        """PEXPIRE of the engine's epoch counter, refreshed by every claim and renewal:
        30 leases, at least a minute, so it outlives a holder's pauses, but never longer
        than ``engine_ttl_ms``, so it does not outlive its engine (tokens stay unique
        without it: each carries its holder's nonce)."""
        return min(self.engine_ttl_ms, max(60_000, 30 * self.lease_ms))

    @property
    def wait_ms(self) -> int:
        """How long past its deadline a lookup may stay unanswered (the partial answer)."""
        return self.partial_answer_wait_ms if self.partial_answers else 0

    @property
    def longest_timeout_ms(self) -> int:
        """The ceiling of every lookup's deadline, waiting for a partial answer included:
        ``lookup_timeout_max_ms``, or by default what fits the pin TTL (see the field)."""
        base = self.lookup_timeout_ms
        ceiling = self.lookup_timeout_max_ms
        if ceiling is None:
            ceiling = max(base, min(4 * base, (base + self.worker_pin_ttl_ms) // 2 - self.wait_ms))
        # No prompt is longer than max_chunks_per_request chunks, so no deadline is longer
        # than that prompt's (with a flat deadline, the base itself).
        largest = self.max_chunks_per_request * self.chunk_size
        scaled = base + self.lookup_timeout_per_1k_tokens_ms * largest // 1000
        return min(ceiling, scaled) + self.wait_ms

    def deadline_rule(self) -> DeadlineRule:
        """The deadline as a function of the prompt, computed once (the client keeps it:
        ``lookup()`` applies it to every lookup)."""
        return DeadlineRule(
            self.lookup_timeout_ms,
            self.lookup_timeout_per_1k_tokens_ms,
            self.longest_timeout_ms - self.wait_ms,
        )

    def lookup_budget_ms(self, tokens: int) -> int:
        """A lookup's deadline, in ms after it was submitted, for a prompt of ``tokens``
        (see :class:`DeadlineRule`)."""
        return self.deadline_rule().budget_ms(tokens)

    @property
    def retention_ms(self) -> int:
        """How long the client keeps a finished, uncleared result: ``result_retention_ms``,
        or by default 30 s cut to what the ranks' pin TTL leaves after the longest deadline."""
        if self.result_retention_ms is not None:
            return self.result_retention_ms
        return min(30_000, self.worker_pin_ttl_ms - self.longest_timeout_ms)

    @property
    def key_ttl_ms(self) -> int:
        """PEXPIRE of a lookup hash with the longest deadline: that deadline plus grace
        (each submit sets its own lookup's deadline plus grace)."""
        return self.longest_timeout_ms + self.key_grace_ms

    # The loaders live in config.sources (which imports this module): each method here is
    # one of its functions, so every path loads in the one order it documents.

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str = "mapping") -> LookupConfig:
        """Build from plain values (a parsed file), lax about str/int forms; unknown keys fail."""
        from broker_lookup.config import sources

        return sources.from_mapping(cls, values, source)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, base: LookupConfig | None = None
    ) -> LookupConfig:
        """``base`` (or the defaults) overridden by every ``BROKER_LOOKUP_<FIELD>`` set.

        Raises:
            ConfigError: A bad value, or a ``BROKER_LOOKUP_*`` variable that is neither a
                field's nor one of ``env.OTHER_VARIABLES`` (a misspelling).
        """
        from broker_lookup.config import sources

        return sources.from_env(cls, environ, base)

    @classmethod
    def from_file(cls, path: str | Path) -> LookupConfig:
        """Load a YAML (``.yaml``/``.yml``) or TOML (``.toml``) file of config fields."""
        from broker_lookup.config import sources

        p = Path(path)
        return cls.from_mapping(sources.read_file(p), source=sources.file_origin(p))

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        environ: Mapping[str, str] | None = None,
        *,
        lmcache: sources.Given | None = None,
        flags: Mapping[str, str] | None = None,
        **fields: Any,
    ) -> LookupConfig:
        """The config from every source, each overriding the one before: the defaults, the
        file (``path``, or ``BROKER_LOOKUP_CONFIG_FILE``), the LMCache config (``lmcache``,
        as the LMCache integration reads it), the ``BROKER_LOOKUP_*`` variables, ``flags``
        (field -> the text a command-line flag gave), then ``fields`` (keywords, as
        ``LookupConfig(...)`` takes them). Validated once, so an error names where its
        value came from (see :mod:`broker_lookup.config.sources`).

        >>> LookupConfig.load(environ={}, redis_url="redis://cache:6379/0").redis_url
        'redis://cache:6379/0'
        """
        from broker_lookup.config import sources

        return sources.load(cls, path, environ, lmcache=lmcache, flags=flags, fields=fields)


class LookupMetadata(_Validated, frozen=True, kw_only=True):
    """Who this process is: LMCache's ``LMCacheMetadata`` fields the lookup path uses.

    >>> LookupMetadata(engine_id="vllm-0", world_size=4).worker_id
    0
    """

    engine_id: str  #: vLLM's kv_transfer_config.engine_id; namespaces every key
    world_size: int  #: TP x PP ranks
    worker_id: int = 0  #: this process's rank (the scheduler is 0)
    use_mla: bool = False  #: MLA models ask rank 0 only
    kv_connector_extra_config: dict[str, Any] | None = None  #: vLLM's extra config, copied
    #: the engine id the operator configured, where ``engine_id`` was derived from it (a
    #: vLLM instance's own namespace, see ``instance_engine_id``); shown in heartbeats
    configured_engine_id: str | None = None

    def _check(self) -> None:
        try:
            validate_engine_id(self.engine_id)
            if self.configured_engine_id is not None:
                validate_configured_id(self.configured_engine_id, "configured_engine_id")
        except ConfigError as exc:
            raise ConfigError(f"{exc} (env {env_name('engine_id')})") from None
        _require(self.world_size >= 1, "world_size", self.world_size, "must be >= 1")
        _require(
            0 <= self.worker_id < self.world_size,
            "worker_id",
            self.worker_id,
            f"must be in [0, world_size={self.world_size})",
        )


def expected_ranks(config: LookupConfig, metadata: LookupMetadata) -> tuple[int, ...]:
    """Ranks a lookup is sent to, by LMCache's ``get_lookup_server_worker_ids`` rule."""
    ids = config.lookup_server_worker_ids
    if not ids:
        return (0,) if metadata.use_mla else tuple(range(metadata.world_size))
    bad = [i for i in ids if not 0 <= i < metadata.world_size]
    if bad:
        raise ConfigError(
            f"lookup_server_worker_ids={ids!r} (env {env_name('lookup_server_worker_ids')}) "
            f"names rank(s) {bad} outside world_size={metadata.world_size}"
        )
    return tuple(sorted(set(ids)))

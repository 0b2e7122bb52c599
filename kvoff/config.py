"""The offloading configuration: the one configuration object of the library.

:class:`OffloadingConfig` says how big the CPU pool is, how big an offloaded block is, which
eviction policy runs it and how the pool is used (ranks, hashing, events, pinning). It is a
frozen pydantic model: ``OffloadingConfig(**kwargs)`` validates the given values and reads
nothing else. :meth:`OffloadingConfig.load` builds one from layered sources with
pydantic-settings, highest precedence first::

    explicit overrides (the CLI, a dict)  >  KVOFF_* environment variables  >  a JSON/YAML file
    >  defaults

Every path (constructor, :meth:`~OffloadingConfig.from_dict`, :meth:`~OffloadingConfig.load`)
runs the same field definitions and validators.
"""

from __future__ import annotations

import contextvars
import decimal
import difflib
import json
import operator
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar

import pydantic
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    JsonConfigSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from kvoff.sizing import _count, compute_num_cpu_blocks

__all__ = [
    "CONFIG_FILE_ENV",
    "ENV_PREFIX",
    "EVICTION_POLICIES",
    "ConfigError",
    "OffloadingConfig",
    "parse_byte_size",
]

ENV_PREFIX = "KVOFF_"
"""Prefix of the environment variables read by :meth:`OffloadingConfig.load`."""

CONFIG_FILE_ENV = "KVOFF_CONFIG_FILE"
"""Environment variable naming a configuration file when :meth:`OffloadingConfig.load` gets none."""


def _eviction_policies() -> tuple[str, ...]:
    from kvoff import _scheduler

    return tuple(_scheduler.eviction_policies())


EVICTION_POLICIES: tuple[str, ...] = _eviction_policies()
"""Names accepted by ``eviction_policy`` (from the C++ policy registry)."""


class ConfigError(ValueError):
    """A configuration that cannot be loaded: an unknown key, a bad file or a bad value. The
    message says where the offending value came from (argument, environment variable, file)."""


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_byte_size(text: str, *, allow_zero: bool = False) -> int:
    """Parse a byte count such as ``4096``, ``512MiB``, ``2GiB``, ``1.5GB`` or ``1e9`` (SI or
    IEC units, case-insensitive). The arithmetic is exact (decimal, in a private context, so
    neither the process-wide decimal context nor a long byte count changes the result).

    Args:
        text: the byte count, an optional unit after it.
        allow_zero: accept a zero count (``"0"``, ``"0MiB"``); otherwise it is refused.

    Returns:
        the number of bytes, in ``1 .. 2**63 - 1`` (or 0 with ``allow_zero``).

    Raises:
        ValueError: for text that is not a positive whole number of bytes (``"1.5"`` bytes is
            not; ``"1.5KiB"`` is 1,536), or one of 2**63 bytes or more (also for an exponent
            too large for decimal arithmetic, such as ``"1e9999999"``).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"{text!r} is not a byte count; write e.g. 4096, 512MiB, 2GiB or 1.5GB")
    too_large = f"{text!r} is too large a byte count (at most 2**63 - 1 bytes)"
    not_whole = (
        f"{text!r} is not a whole number of bytes; write an integer count or use a larger unit"
    )
    try:
        # the constructor is exact whatever the context; only an absurd exponent fails here
        digits = decimal.Decimal(m.group(1))
    except (decimal.InvalidOperation, decimal.Overflow):
        raise ValueError(f"{too_large[:-1]}; its exponent is out of range)") from None
    if digits.is_zero():
        if allow_zero:
            return 0
        raise ValueError(f"{text!r}: the byte count must be positive")
    if digits.adjusted() >= 19:  # >= 1e19 > 2**63, and every unit is >= 1
        raise ValueError(too_large)
    if digits.adjusted() < -20:  # < 1e-20 x at most 2**40 (TiB): below one byte, not 0
        raise ValueError(not_whole)
    # a private context, whatever the process-wide one says (invariant: exact arithmetic): the
    # product of a number of n digits and a unit of at most 13 digits has at most n + 13 digits
    context = decimal.Context(
        prec=len(digits.as_tuple().digits) + 20,
        Emax=decimal.MAX_EMAX,
        Emin=decimal.MIN_EMIN,
        traps=[decimal.InvalidOperation, decimal.Overflow, decimal.Inexact],
    )
    try:
        number = context.multiply(digits, decimal.Decimal(_BYTE_UNITS[m.group(2).lower()]))
    except decimal.DecimalException:  # cannot happen with the precision above; be safe
        raise ValueError(too_large) from None
    if number >= 2**63:
        raise ValueError(too_large)
    if number != number.to_integral_value():
        raise ValueError(
            f"{text!r} is {number} bytes, not a whole number of bytes; write an integer count "
            "or use a larger unit"
        )
    return int(number)


def _bytes_before(value: Any) -> Any:
    return parse_byte_size(value) if isinstance(value, str) else _not_bool(value)


def _not_bool(value: Any) -> Any:
    """Refuses a bool where a count belongs (pydantic's lax mode reads True as 1)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    return value


def _empty_is_none(value: Any) -> Any:
    """An empty path (``KVOFF_DISK_PATH=""``) means unset, not the current directory."""
    if isinstance(value, str) and not value.strip():
        return None
    return value


_MAX_INT = 2**63 - 1  # sizes and counts reach the C++ core as int64

Count = Annotated[PositiveInt, BeforeValidator(_not_bool), Field(le=_MAX_INT)]
"""A positive count (blocks, tokens, ranks): an int, not a bool, below 2**63."""

Seconds = Annotated[PositiveFloat, BeforeValidator(_not_bool)]
"""A positive number of seconds: a number, not a bool (pydantic's lax mode reads True as 1.0)."""

Fraction = Annotated[NonNegativeFloat, BeforeValidator(_not_bool), Field(allow_inf_nan=False)]
"""A finite fraction >= 0 (not a bool, not inf or nan)."""

OptionalPath = Annotated[Path | None, BeforeValidator(_empty_is_none)]
"""A path, or unset (``None``, or an empty string)."""


def _secret_before(value: Any) -> Any:
    """``shared_secret``'s input: text (or a ``SecretStr``) as given, empty text as unset.
    Anything else becomes an empty secret, which :func:`_secret_after` refuses (the error shows
    neither: :meth:`OffloadingConfig._hide_secret`)."""
    if value is None or isinstance(value, SecretStr):
        return value
    if isinstance(value, str):
        return SecretStr(value) if value else None
    return SecretStr("")


def _secret_after(value: SecretStr | None) -> SecretStr | None:
    if value is not None and len(value.get_secret_value().encode()) < 16:
        raise ValueError(
            "shared_secret must be text of at least 16 bytes (UTF-8); generate one with "
            "`openssl rand -hex 32`"
        )
    return value


def _auto_before(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() in ("auto", "none", "null", ""):
        return None
    return value


ByteCount = Annotated[PositiveInt, BeforeValidator(_bytes_before), Field(le=_MAX_INT)]
"""A positive number of bytes: an int, or a string with an optional unit (``"40GiB"``)."""


def _bytes_or_zero_before(value: Any) -> Any:
    if isinstance(value, str):
        return parse_byte_size(value, allow_zero=True)  # "0", "0MiB": off, whatever the unit
    return _not_bool(value)


ByteCountOrZero = Annotated[
    NonNegativeInt, BeforeValidator(_bytes_or_zero_before), Field(le=_MAX_INT)
]
"""A number of bytes that may be 0 (off): an int, or a string with an optional unit."""


class OffloadingConfig(BaseModel):
    """Configuration of one kvoff CPU pool (frozen; unknown keys are rejected).

    Exactly one of ``cpu_bytes_to_use`` and ``num_cpu_blocks`` sizes the pool.

    The constructor validates its arguments only; :meth:`load` also reads a JSON/YAML file and
    ``KVOFF_*`` environment variables, :meth:`from_dict` a mapping with helpful key errors.

    Attributes:
        cpu_bytes_to_use: bytes of CPU memory for the pool, summed over all tensor-parallel
            ranks: an int or a string with a unit (``"40GiB"``, ``"512MiB"``, ``"1.5GB"``). The
            slot count is derived by :func:`kvoff.sizing.compute_num_cpu_blocks`.
        num_cpu_blocks: the pool size in offloaded blocks (slots), when given directly.
        offloaded_block_size: tokens per offloaded block (the CPU-side unit). ``None`` means
            the GPU block size (``block_size_factor == 1``). Must be a multiple of the GPU
            ``block_size`` (and of ``hash_block_size`` when that is given).
        eviction_policy: one of :data:`EVICTION_POLICIES` (case-insensitive).
        world_size: tensor-parallel ranks sharing ``cpu_bytes_to_use`` (default 1).
        hash_block_size: tokens per block hash of the engine's prefix hashing; ``None`` means
            the GPU block size.
        enable_events: whether the manager records block stored/removed events (default off).
        offload_prompt_only: store only the offloaded blocks that lie wholly inside each
            request's prompt (default on), not those that decode fills. vLLM 0.32's
            OffloadingConnector has the same key and default (so both ways into vLLM store the
            same blocks), and LMCache saves no decode KV by default either. Output blocks are
            reused only where a later prompt repeats the output token for token (a chat turn
            re-sending the answer verbatim); elsewhere they take pool room from prompt blocks
            that are reused. Set it off for chat traffic that re-sends answers verbatim.
            Measurement: docs/vllm.md.
        pin_memory: whether the CPU pool uses pinned (page-locked) memory; ``None`` (also
            ``"auto"`` in files and the environment) pins when CUDA is available.
        transfer_mechanism: how jobs copy: ``"auto"`` (per job: the fastest mechanism whose
            slowdown of concurrent compute is within ``compute_slowdown_budget``, from measured
            thresholds, :mod:`kvoff.transfer`) or one of ``"memcpy"``, ``"batch"``,
            ``"kernel"``, ``"per_block"``, ``"staged"`` for every job.
        transfer_thresholds: a thresholds JSON file for ``"auto"`` (written by ``kvoff bench
            transfer --sweep --write-thresholds FILE``); ``None``: ``$KVOFF_TRANSFER_THRESHOLDS``
            or the packaged H100 measurement.
        compute_slowdown_budget: the largest slowdown of the forward pass that ``"auto"``
            accepts for a transfer, as a finite fraction >= 0 (default 0.03: 3 %; a concurrent
            bf16 GEMM measured by ``kvoff bench transfer``).
        staging_bytes: GPU staging buffer of each worker for staged transfers of layer-major
            caches, both directions together (an int or ``"64MiB"``; default 64 MiB; 0
            disables staging). It comes out of the GPU memory the engine has.
        disk_path: a folder for the disk tier below the CPU pool (:class:`kvoff.tiers.DiskTier`:
            one preallocated file, O_DIRECT where the filesystem allows, survives restarts);
            ``None``: no disk tier. Needs ``disk_bytes``.
        disk_bytes: the disk tier's size (an int or ``"100GiB"``); only with ``disk_path``.
        remote_url: a Redis Cluster node for the shared tier (``redis://host:7000``;
            :class:`kvoff.tiers.redis_cluster.RedisClusterTier`); ``None``: no shared tier.
        remote_namespace: the shared tier's key prefix (no spaces or ``:``; default
            ``"kvoff"``). Keys also carry the model/layout/rank fingerprint.
        remote_ttl_s: seconds a block lives in Redis (``None``: until Redis evicts it); finite,
            at most 2**62 ms (:data:`kvoff.tiers.cluster_url.MAX_TTL_MS`).
        remote_timeout_s: per-node timeout in seconds after which a slow or failed node is a
            miss (default 0.25); finite, at most 1e9.
        tier_write_queue_blocks: CPU blocks pinned for write-through to the tiers at most;
            beyond that writes are dropped and counted (``None``: a quarter of the pool, at
            most 1,024; :func:`kvoff.tiers.coordinator.default_write_queue_blocks`).
        store_batch_blocks: store batching, in offloaded blocks (1 to 2**20; default 4): a
            running request's full blocks are stored once this many wait, and the rest when it
            finishes (:class:`kvoff.OffloadingScheduler`; the engine keeps those blocks until
            that store is submitted). Decode fills one block every ``offloaded_block_size``
            tokens, so 4 makes about a quarter as many store jobs as 1, which stores every
            block in the step it fills (docs/design.md step 2). While a request runs its blocks stay
            in the engine's own prefix cache, so the wait loses no hit. A model with a
            sliding-window or Mamba group always uses 1. The default's measurement:
            docs/scheduler.md#store-batching.
        store_threshold: store admission, in offers (0 to 2**20; default 0, off; vLLM's key of
            the same name): with n >= 2 an offloaded block is stored in the CPU pool only once
            requests offered it n times (a request that computed the block and reached it is
            one offer), so blocks used once never take a slot. 0 or 1 stores every block.
            Skipped blocks are counted (``stores_skipped``).
            docs/eviction-policies.md#store-admission-store_threshold.
        max_tracker_size: keys whose offers ``store_threshold`` counts at most, the least
            recently offered forgotten first (1 to 2**31 - 1; default 64000, vLLM's; about 104
            bytes of host memory each; unused while ``store_threshold`` < 2).
        shared_secret: the secret of the MAC (keyed BLAKE3) every block written to the disk
            and Redis tiers carries (text; the MAC's key is derived from its UTF-8 bytes, at
            least 16 bytes, e.g. the output of ``openssl rand -hex 32``); ``None`` (default): no
            MAC. Blocks without a valid MAC
            are misses, counted in the tier's ``unauthenticated_blocks``, never served
            (:mod:`kvoff.tiers.block_format`). Every engine sharing a tier needs the same
            secret. A ``pydantic.SecretStr``: ``repr``, ``str`` and errors never show it; set
            it with ``KVOFF_SHARED_SECRET`` rather than in a file others can read.
        node_pool: the socket of a node pool (``kvoff pool serve``; docs/node-pool.md), an
            absolute path: the CPU pool is the node pool's, shared by every engine on the
            machine, so neither ``cpu_bytes_to_use`` nor ``num_cpu_blocks`` is given.
            ``KvoffOffloadingSpec`` only, for now (tensor-parallel engines on a pool served with
            ``--ranks``); tiers are the pool's (``kvoff pool serve --disk-path ...
            --remote-url ...``), none are given here.

    Raises:
        pydantic.ValidationError (a ``ValueError``): on a non-positive size, both or neither of
            the two sizes, an unknown policy (the message lists the choices), a remote TTL or
            timeout that is not finite or too long, a negative or non-finite
            ``compute_slowdown_budget``, a ``store_threshold`` outside [0, 2**20], a
            ``max_tracker_size`` outside [1, 2**31 - 1], a bool where a number belongs, a
            ``shared_secret`` shorter than 16 bytes or not text, a ``node_pool`` that is not
            an absolute path or comes with a pool size, tiers or ``world_size`` > 1, or an
            unknown key.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_bytes_to_use: ByteCount | None = None
    num_cpu_blocks: Count | None = None
    offloaded_block_size: Count | None = None
    eviction_policy: str = "lru"
    world_size: Count = 1
    hash_block_size: Count | None = None
    enable_events: bool = False
    offload_prompt_only: bool = True
    pin_memory: Annotated[bool | None, BeforeValidator(_auto_before)] = None
    transfer_mechanism: str = "auto"
    transfer_thresholds: OptionalPath = None
    compute_slowdown_budget: Fraction = 0.03
    staging_bytes: ByteCountOrZero = 64 << 20
    disk_path: OptionalPath = None
    disk_bytes: ByteCount | None = None
    remote_url: str | None = None
    remote_namespace: str = "kvoff"
    remote_ttl_s: Seconds | None = None
    remote_timeout_s: Seconds = 0.25
    tier_write_queue_blocks: Count | None = None
    store_batch_blocks: Annotated[Count, Field(le=1 << 20)] = 4
    store_threshold: Annotated[NonNegativeInt, BeforeValidator(_not_bool), Field(le=1 << 20)] = 0
    max_tracker_size: Annotated[Count, Field(le=2**31 - 1)] = 64000
    shared_secret: Annotated[
        SecretStr | None, BeforeValidator(_secret_before), AfterValidator(_secret_after)
    ] = None
    node_pool: str | None = None

    _POOL_SIZE_KEYS: ClassVar[tuple[str, str]] = ("cpu_bytes_to_use", "num_cpu_blocks")

    @field_validator("eviction_policy", "transfer_mechanism")
    @classmethod
    def _known_name(cls, value: str, info: pydantic.ValidationInfo) -> str:
        from kvoff.transfer import ALL_MECHANISMS

        choices = EVICTION_POLICIES if info.field_name == "eviction_policy" else ALL_MECHANISMS
        name = value.strip().lower()
        if name not in choices:
            raise ValueError(f"unknown {info.field_name} {value!r}; choose one of {list(choices)}")
        return name

    @field_validator("remote_ttl_s", "remote_timeout_s")
    @classmethod
    def _remote_seconds(cls, value: float | None, info: pydantic.ValidationInfo) -> float | None:
        from kvoff.tiers.cluster_url import check_timeout_s, check_ttl_s

        # the tier's own checks (finite; a TTL Redis accepts), naming the configuration key
        if info.field_name == "remote_ttl_s":
            check_ttl_s(value, "remote_ttl_s")
        else:
            check_timeout_s(value, "remote_timeout_s")
        return value

    @model_validator(mode="after")
    def _one_size(self) -> OffloadingConfig:
        if self.node_pool is not None:
            return self._node_pool_keys()
        if (self.cpu_bytes_to_use is None) == (self.num_cpu_blocks is None):
            raise ValueError(
                "size the CPU pool with exactly one of cpu_bytes_to_use (bytes) or "
                f"num_cpu_blocks (offloaded blocks); got cpu_bytes_to_use="
                f"{self.cpu_bytes_to_use}, num_cpu_blocks={self.num_cpu_blocks}"
            )
        return self

    @model_validator(mode="after")
    def _whole_hash_blocks(self) -> OffloadingConfig:
        obs, hbs = self.offloaded_block_size, self.hash_block_size
        if obs is not None and hbs is not None and obs % hbs:
            raise ValueError(
                f"offloaded_block_size={obs} tokens is not a multiple of hash_block_size={hbs} "
                f"tokens; use a multiple such as {max(1, obs // hbs) * hbs}"
            )
        return self

    @model_validator(mode="after")
    def _tier_keys(self) -> OffloadingConfig:
        if (self.disk_path is None) != (self.disk_bytes is None):
            raise ValueError(
                "the disk tier needs both disk_path (a folder) and disk_bytes (its size, e.g. "
                f"'100GiB'); got disk_path={self.disk_path}, disk_bytes={self.disk_bytes}"
            )
        if self.remote_url is not None:
            from kvoff.tiers.cluster_url import parse_cluster_url

            parse_cluster_url(self.remote_url)  # the tier's own check: names the URL and the fix
        ns = self.remote_namespace
        if not ns or any(c in ns for c in " :\n\t"):
            raise ValueError(f"remote_namespace={ns!r} must be non-empty, without spaces or ':'")
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _hide_secret(cls, data: Any, handler: pydantic.ModelWrapValidatorHandler[Any]) -> Any:
        """Validation errors never show ``shared_secret``: pydantic puts each error's input in
        its text and ``errors()`` (a model-level error's input is every key given), so the
        errors are raised again with the secret replaced by ``**********``."""
        try:
            return handler(data)
        except pydantic.ValidationError as exc:
            if not isinstance(data, Mapping) or data.get("shared_secret") is None:
                raise
            hidden, title = "**********", exc.title
            details: list[Any] = []
            for err in exc.errors():
                value = err["input"]
                if err["loc"][:1] == ("shared_secret",):
                    value = hidden
                elif isinstance(value, Mapping) and "shared_secret" in value:
                    value = {**value, "shared_secret": hidden}
                detail = {"type": err["type"], "loc": err["loc"], "input": value}
                if "ctx" in err:
                    detail["ctx"] = err["ctx"]
                details.append(detail)
        # raised outside the handler, so the original error is not chained to it
        raise pydantic.ValidationError.from_exception_data(title, details)

    def _node_pool_keys(self) -> OffloadingConfig:
        path = self.node_pool
        assert path is not None
        if not os.path.isabs(path):
            raise ValueError(
                f"node_pool={path!r} must be an absolute path: the socket of kvoff pool serve "
                "(e.g. /run/user/1000/kvoff-pool-1000.sock)"
            )
        if self.cpu_bytes_to_use is not None or self.num_cpu_blocks is not None:
            raise ValueError(
                "with node_pool the CPU pool is the node pool's (kvoff pool serve --bytes); drop "
                "cpu_bytes_to_use and num_cpu_blocks"
            )
        if self.has_tiers:
            raise ValueError(
                "with node_pool the tiers are the node pool's: give --disk-path / --remote-url "
                "to kvoff pool serve and drop disk_path and remote_url here"
            )
        return self

    @property
    def has_tiers(self) -> bool:
        """Whether a secondary tier (disk or remote) is configured."""
        return self.disk_path is not None or self.remote_url is not None

    # ----------------------------------------------------------------------------- loading

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OffloadingConfig:
        """Validate a mapping of field names to values (values as in a file: ``"40GiB"``...).

        Raises:
            ConfigError: for an unknown key; the message names it and the closest valid key.
            pydantic.ValidationError: for a bad value.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"a kvoff configuration is a mapping of keys to values, got {type(data).__name__}"
            )
        _check_keys(data, "the configuration dict")
        return cls.model_validate(dict(data))

    @classmethod
    def load(
        cls,
        file: str | os.PathLike[str] | None = None,
        *,
        env: bool = True,
        defaults: Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> OffloadingConfig:
        """Build the configuration from layered sources, highest precedence first:

        1. ``overrides`` (keyword arguments: the CLI, a dict);
        2. ``KVOFF_<FIELD>`` environment variables (e.g. ``KVOFF_CPU_BYTES_TO_USE=8GiB``),
           unless ``env`` is false;
        3. ``file``, or the file named by ``KVOFF_CONFIG_FILE`` (when ``env``): JSON for
           ``.json``, YAML for ``.yaml``/``.yml``;
        4. ``defaults`` (a caller's fallbacks, e.g. the CLI's default pool size), then the field
           defaults.

        The pool is sized by the highest level that sets ``cpu_bytes_to_use`` or
        ``num_cpu_blocks``: a level that sets one of them hides both in the levels below it.
        An explicit ``None`` override unsets a key.

        Raises:
            ConfigError: for an unknown key (naming it, where it came from and the closest valid
                key), an unreadable or unsupported file, or a bad value (naming the argument,
                ``KVOFF_*`` variable or file it came from).
            FileNotFoundError: when the named file does not exist.
        """
        _check_keys(overrides, "the arguments")
        if defaults is not None:
            _check_keys(defaults, "the defaults")
        path: Path | None = None
        if file is not None:
            path = Path(file).expanduser()
        elif env and os.environ.get(CONFIG_FILE_ENV):
            path = Path(os.environ[CONFIG_FILE_ENV]).expanduser()
        if path is not None:
            if path.suffix.lower() not in (".json", ".yaml", ".yml"):
                raise ConfigError(
                    f"configuration file {str(path)!r}: unsupported suffix {path.suffix!r}; "
                    "use .json, .yaml or .yml"
                )
            if not path.is_file():
                raise FileNotFoundError(f"configuration file {str(path)!r} does not exist")
        token = _LOAD_OPTIONS.set(_LoadOptions(path, env, dict(defaults or {})))
        try:
            settings = _OffloadingSettings(**overrides)
        except pydantic.ValidationError as exc:
            raise ConfigError(_explain(exc)) from exc
        finally:
            _LOAD_OPTIONS.reset(token)
        return cls.model_validate({k: getattr(settings, k) for k in settings.model_fields_set})

    # ------------------------------------------------------------------------------ sizing

    def worker_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`kvoff.OffloadingWorker` from this config:
        ``pin_memory``, ``mechanism``, ``thresholds`` (read from
        ``transfer_thresholds`` when set), ``compute_slowdown_budget`` and ``staging_bytes``.

        Raises:
            ValueError: when the thresholds file cannot be read or is invalid.
        """
        from kvoff.transfer import load_thresholds

        return {
            "pin_memory": self.resolve_pin_memory(),
            "mechanism": self.transfer_mechanism,
            "thresholds": (
                None
                if self.transfer_thresholds is None
                else load_thresholds(self.transfer_thresholds)
            ),
            "compute_slowdown_budget": self.compute_slowdown_budget,
            "staging_bytes": self.staging_bytes,
        }

    def resolve_pin_memory(self) -> bool:
        """``pin_memory``, with ``None`` (auto) meaning: pin when CUDA is available."""
        if self.pin_memory is not None:
            return self.pin_memory
        import torch

        return bool(torch.cuda.is_available())

    def block_size_factor(self, block_size: int) -> int:
        """GPU blocks per offloaded block for GPU blocks of ``block_size`` tokens.

        Raises:
            ValueError: when ``block_size`` is not a positive int (a numpy integer is taken; a
                bool or a float is not), or ``offloaded_block_size`` is not a multiple of it.
        """
        if (
            isinstance(block_size, bool)
            or not hasattr(block_size, "__index__")
            or operator.index(block_size) < 1
        ):
            raise ValueError(
                f"block_size must be a positive int number of tokens, got {block_size!r}"
            )
        block_size = operator.index(block_size)
        obs = self.offloaded_block_size or block_size
        if obs % block_size:
            raise ValueError(
                f"offloaded_block_size={obs} tokens is not a multiple of the GPU block_size="
                f"{block_size} tokens; use a multiple such as "
                f"{max(1, obs // block_size) * block_size}"
            )
        return obs // block_size

    def resolve_num_cpu_blocks(
        self, bytes_per_gpu_block: int, block_size: int, world_size: int | None = None
    ) -> int:
        """Slots of the CPU pool: ``num_cpu_blocks``, or derived from ``cpu_bytes_to_use``.

        Args:
            bytes_per_gpu_block: bytes of one GPU block over all layers of one rank (>= 0).
            block_size: GPU tokens per block (>= 1).
            world_size: tensor-parallel ranks (>= 1; default: ``self.world_size``).

        All three are checked first, whichever way the pool is sized; numpy integers are taken.

        Returns:
            the number of CPU slots (offloaded blocks).

        Raises:
            TypeError: ``bytes_per_gpu_block``, ``block_size`` or ``world_size`` is not an
                integer (a float, a str or a bool); the message names the argument.
            ValueError: a negative ``bytes_per_gpu_block``, a ``block_size`` or ``world_size``
                below 1, an ``offloaded_block_size`` that is not a multiple of ``block_size``,
                or a ``cpu_bytes_to_use`` that cannot hold even one offloaded block (the
                message gives the bytes one offloaded block needs).
        """
        bytes_per_gpu_block = _count("bytes_per_gpu_block", bytes_per_gpu_block)
        block_size = _count("block_size", block_size)
        world_size = self.world_size if world_size is None else _count("world_size", world_size)
        if bytes_per_gpu_block < 0:
            raise ValueError(f"bytes_per_gpu_block must be >= 0 bytes, got {bytes_per_gpu_block}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1 tensor-parallel ranks, got {world_size}")
        factor = self.block_size_factor(block_size)
        if self.num_cpu_blocks is not None:
            return self.num_cpu_blocks
        assert self.cpu_bytes_to_use is not None
        n = compute_num_cpu_blocks(self.cpu_bytes_to_use, bytes_per_gpu_block, factor, world_size)
        if n == 0 and bytes_per_gpu_block > 0:
            need = bytes_per_gpu_block * factor * world_size
            raise ValueError(
                f"cpu_bytes_to_use={self.cpu_bytes_to_use} bytes cannot hold one offloaded block "
                f"({need} bytes = {bytes_per_gpu_block} bytes per GPU block × block_size_factor "
                f"{factor} × world_size {world_size}); raise cpu_bytes_to_use to at least {need}"
            )
        return n


# --------------------------------------------------------------------------------- loading
# OffloadingConfig.load() runs pydantic-settings over a private BaseSettings subclass of
# OffloadingConfig: the same fields and validators, plus the sources. The plain model never
# reads the environment.

_FIELDS: tuple[str, ...] = tuple(OffloadingConfig.model_fields)


def _check_keys(data: Mapping[Any, Any], where: str) -> None:
    """Raise :class:`ConfigError` for the first key of ``data`` that is not a field."""
    for key in data:
        if key in OffloadingConfig.model_fields:
            continue
        close = difflib.get_close_matches(str(key), _FIELDS, n=1, cutoff=0.5) or [
            f for f in _FIELDS if str(key) and (f.startswith(str(key)) or str(key).startswith(f))
        ]
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"unknown key {key!r} in {where}; {hint}valid keys: {', '.join(_FIELDS)}")


class _LoadOptions:
    """What one :meth:`OffloadingConfig.load` call reads, and where each value came from."""

    def __init__(self, path: Path | None, env: bool, defaults: dict[str, Any]) -> None:
        self.path = path
        self.env = env
        self.defaults = defaults
        self.origin: dict[str, str] = {}


_LOAD_OPTIONS: contextvars.ContextVar[_LoadOptions | None] = contextvars.ContextVar(
    "kvoff_config_load_options", default=None
)


def _options() -> _LoadOptions:
    opts = _LOAD_OPTIONS.get()
    if opts is None:  # the settings class used outside load(): arguments only
        opts = _LoadOptions(None, False, {})
        _LOAD_OPTIONS.set(opts)
    return opts


def _env_var_name(field: str) -> str:
    """The environment variable that sets ``field`` (as spelled in the environment)."""
    want = f"{ENV_PREFIX}{field}".upper()
    return next((name for name in os.environ if name.upper() == want), want)


class _Level(PydanticBaseSettingsSource):
    """One precedence level of :meth:`OffloadingConfig.load`: the values of ``inner``, minus the
    pool size when a higher level already sized the pool; records where each value came from."""

    def __init__(self, settings_cls: type[BaseSettings], inner: Any, origin: str) -> None:
        super().__init__(settings_cls)
        self.inner = inner
        self.origin = origin

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # pragma: no cover - __call__ does the work

    def __call__(self) -> dict[str, Any]:
        data = dict(self.inner())
        higher = self.current_state
        if any(higher.get(k) is not None for k in OffloadingConfig._POOL_SIZE_KEYS):
            for key in OffloadingConfig._POOL_SIZE_KEYS:
                data.pop(key, None)
        origins = _options().origin
        for key in data:
            if key not in higher:
                origins[key] = (
                    f"environment variable {_env_var_name(key)}"
                    if self.origin == "env"
                    else self.origin
                )
        return data


class _FileMixin:
    """Reads a configuration file with errors that name it; rejects unknown keys."""

    def _check(self, data: Any, path: Path) -> dict[str, Any]:
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise ConfigError(
                f"configuration file {str(path)!r} must hold a mapping of keys to values, "
                f"not {type(data).__name__}"
            )
        _check_keys(data, f"configuration file {str(path)!r}")
        return data


class _JsonFile(_FileMixin, JsonConfigSettingsSource):
    def _read_file(self, file_path: Path) -> dict[str, Any]:
        try:
            data = json.loads(file_path.read_text(encoding=self.json_file_encoding))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"configuration file {str(file_path)!r} is not JSON: {exc}") from exc
        return self._check(data, file_path)


class _YamlFile(_FileMixin, YamlConfigSettingsSource):
    def _read_file(self, file_path: Path) -> dict[str, Any]:
        import yaml

        try:
            data = yaml.safe_load(file_path.read_text(encoding=self.yaml_file_encoding))
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise ConfigError(f"configuration file {str(file_path)!r} is not YAML: {exc}") from exc
        return self._check(data, file_path)


class _OffloadingSettings(BaseSettings, OffloadingConfig):
    """The sources of :meth:`OffloadingConfig.load`; the fields and validators are inherited."""

    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",
        env_prefix=ENV_PREFIX,
        case_sensitive=False,
        title="OffloadingConfig",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        opts = _options()
        levels: list[PydanticBaseSettingsSource] = [
            _Level(settings_cls, init_settings, "the arguments")
        ]
        if opts.env:
            levels.append(_Level(settings_cls, env_settings, "env"))
        if opts.path is not None:
            file_source = (
                _JsonFile(settings_cls, json_file=opts.path)
                if opts.path.suffix.lower() == ".json"
                else _YamlFile(settings_cls, yaml_file=opts.path)
            )
            levels.append(_Level(settings_cls, file_source, f"file {str(opts.path)!r}"))
        if opts.defaults:
            defaults = InitSettingsSource(settings_cls, init_kwargs=opts.defaults)
            levels.append(_Level(settings_cls, defaults, "the defaults"))
        return tuple(levels)


def _explain(exc: pydantic.ValidationError) -> str:
    """The errors of ``exc``, each with the argument, variable or file its value came from."""
    origins = _options().origin
    lines = [f"invalid kvoff configuration ({exc.error_count()} error(s)):"]
    for err in exc.errors():
        loc = err["loc"]
        if loc:
            field = str(loc[0])
            where = origins.get(field, "the defaults")
            lines.append(f"  {field}={err['input']!r} (from {where}): {err['msg']}")
        else:
            given = ", ".join(f"{k} from {v}" for k, v in origins.items())
            lines.append(f"  {err['msg']} ({given or 'nothing given'})")
    return "\n".join(lines)

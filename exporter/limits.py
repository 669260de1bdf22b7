"""The MPS limits in force for a client, and where each came from: one rule, stated once
(README "Where the numbers come from").

A client's own `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` wins per device; where it set
none, its server's limit applies **as it was when the client connected**; a client
whose server is not known gets the daemon's defaults instead. The thread share is
the smaller of the client's own `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and the one it
inherits (the server's, else the default): MPS never lets a client exceed its
server's share.

MPS fixes a client's limits when it connects: on an H100 a client connected under
the server's 8G grew to 3.5 GiB after `set_device_pinned_mem_limit <server> 0 3G`,
and was refused only past 8G, while a client connecting after the change was held
to 3G (tests/gpu/reports/h100-edges.md). So the server's limits at the client's
connection (the MPS logs know them) win over the server's limits now, which are
all there is where the logs do not reach back to the connection.

How CUDA reads the client's own variable (H100, driver 580, MPS 13000; issue 24): the
device keys count the client's *visible* devices (its `CUDA_VISIBLE_DEVICES`: indices,
GPU UUIDs or their prefixes, MIG UUIDs), or name a device by `GPU-<uuid>` or a prefix
of it. `0=2G`, `0=2048M`, `GPU-<uuid>=2G` and `GPU-<first 8 hex>=2G` bind 2 GiB; one
entry naming a device the client cannot see (`0=2G,1=4G` with one GPU visible) drops
every pinned limit of the variable, and a bare `2G` binds none. A thread percentage that
is not a number in (0, 100] is ignored too: `abc` and `150` gave the client all 132 SMs
and 376 products/s of a 4096 x 4096 matmul, as unset, against 26 SMs and 63/s under `20`
(tests/gpu/reports/h100-limits24.md). Such a setting is "ignored": the client runs as if
it had set nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .logs.events import DeviceKey
from .units import ascii_digits, parse_decimal, parse_size, parse_uint, printed_unit

PINNED_MEMORY, ACTIVE_THREADS, PRIORITY = "pinned_memory", "active_threads", "priority"
LIMITS = (PINNED_MEMORY, ACTIVE_THREADS, PRIORITY)
# Where a limit in force came from (mps_client_limit_source{pinned_memory, active_threads, priority}).
CLIENT, SERVER_AT_CONNECT, SERVER_NOW, DAEMON_DEFAULT, NONE = (
    "client", "server_at_connect", "server_now", "daemon_default", "none")
SOURCES = (CLIENT, SERVER_AT_CONNECT, SERVER_NOW, DAEMON_DEFAULT, NONE)
# Why a client's own setting is not in force (mps_client_limit_ignored{reason}).
INVISIBLE_DEVICE, NO_DEVICE, MALFORMED, NOT_A_NUMBER, OUT_OF_RANGE = (
    "invisible_device", "no_device", "malformed", "not_a_number", "out_of_range")
IGNORED_REASONS = (INVISIBLE_DEVICE, NO_DEVICE, MALFORMED, NOT_A_NUMBER, OUT_OF_RANGE)


@dataclass(frozen=True)
class Limits:
    thread_percentage: Optional[float] = None  # 0..100; None: not set
    pinned_bytes: Mapping[int, int] = field(default_factory=dict)  # GPU index -> bytes


@dataclass(frozen=True)
class VisibleDevice:
    """One device a client sees, in its CUDA order: `index` is the NVML GPU index (None for
    a MIG instance, which has no series of its own), `uuid` its GPU or MIG UUID."""

    index: Optional[int]
    uuid: str


def visible_devices(value: Optional[str], gpus: Sequence[Tuple[int, str]]) -> List[VisibleDevice]:
    """The devices a process with CUDA_VISIBLE_DEVICES=`value` sees, of the `gpus` it could
    see ((NVML index, UUID), in their CUDA order: the node's GPUs by index, or a control
    daemon's own devices). Unset: all of them. CUDA stops at the first entry it cannot
    resolve and drops repeats; an index counts `gpus`: under a daemon started with
    CUDA_VISIBLE_DEVICES=1, its clients' device 0 is the node's GPU 1 (issue 38)."""
    if value is None:
        return [VisibleDevice(i, u) for i, u in gpus]
    seen: List[VisibleDevice] = []
    for item in value.split(","):
        item = item.strip()
        device: Optional[VisibleDevice] = None
        if ascii_digits(item):
            position = int(item)
            device = VisibleDevice(*gpus[position]) if position < len(gpus) else None
        elif item.upper().startswith("GPU-"):
            matches = [VisibleDevice(i, u) for i, u in gpus if u.lower().startswith(item.lower())]
            device = matches[0] if len(matches) == 1 else None
        elif item.upper().startswith("MIG-") and len(item) > 4:
            device = VisibleDevice(None, item)
        if device is None:
            break
        if device not in seen:
            seen.append(device)
    return seen


def exact_pinned(answered: Mapping[int, int], logged: Mapping[int, int]) -> Dict[int, int]:
    """A server's pinned limits by GPU index as the control daemon answered them, each
    replaced by the one its server.log wrote in bytes where the answer is that one
    rounded down (units.printed_unit): a server under a default of 1536M logged
    `0x60000000 bytes` and was answered `1G` (H200, driver 580). A logged limit the answer
    does not round it to (set again since, as the log would also say) is not taken."""
    return {gpu: logged[gpu] if gpu in logged and size <= logged[gpu] < size + printed_unit(size) else size
            for gpu, size in answered.items()}


def on_gpus(pinned: Mapping[DeviceKey, int], devices: Sequence[VisibleDevice]) -> Dict[int, int]:
    """Pinned limits keyed as MPS keys them (the daemon's device ordinal, or a GPU UUID or
    a prefix of one, as in server.log's `... for device GPU-<uuid> set to ...`) by the
    node's GPU index; a key naming none of the daemon's devices binds nothing."""
    limits: Dict[int, int] = {}
    for key, size in pinned.items():
        if isinstance(key, int):
            device = devices[key] if 0 <= key < len(devices) else None
        else:
            matches = [d for d in devices if d.uuid.lower().startswith(key.lower())]
            device = matches[0] if len(matches) == 1 else None
        if device is not None and device.index is not None:
            limits[device.index] = size
    return limits


@dataclass(frozen=True)
class OwnLimits:
    """What a client set in its own environment, as CUDA applies it: `limits` the part in
    force; `ignored`: limit kind -> why a setting it made is not in force."""

    limits: Limits = Limits()
    priority: Optional[int] = None
    ignored: Mapping[str, str] = field(default_factory=dict)


def pinned_from_env(value: str, visible: Sequence[VisibleDevice]) -> Tuple[Dict[int, int], Optional[str]]:
    """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT ("0=1G,GPU-1a2b=512M") against the client's
    visible devices: (GPU index -> bytes, None) when in force, ({}, reason) when CUDA drops
    it all; ({}, None) when empty."""
    if not value.strip():
        return {}, None
    limits: Dict[int, int] = {}
    for item in value.split(","):
        key, sep, size_text = (part.strip() for part in item.partition("="))
        if not sep:
            return {}, NO_DEVICE if parse_size(key) is not None else MALFORMED
        size = parse_size(size_text)
        if size is None:
            return {}, MALFORMED
        if ascii_digits(key):
            device = visible[int(key)] if int(key) < len(visible) else None
        elif key.upper().startswith(("GPU-", "MIG-")):
            matches = [d for d in visible if d.uuid.lower().startswith(key.lower())]
            device = matches[0] if len(matches) == 1 else None
        else:
            return {}, MALFORMED
        if device is None:
            return {}, INVISIBLE_DEVICE
        if device.index is not None and size:
            limits[device.index] = size
    return limits, None


def own_limits(env: Mapping[str, str], gpus: Sequence[Tuple[int, str]]) -> OwnLimits:
    """The limits a client's environment (the kept variables, raw) puts in force; `gpus`:
    the devices its daemon sees (`visible_devices` of the daemon's own setting)."""
    ignored: Dict[str, str] = {}
    visible = visible_devices(env.get("CUDA_VISIBLE_DEVICES"), gpus)
    pinned, why = pinned_from_env(env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", ""), visible)
    if why:
        ignored[PINNED_MEMORY] = why
    share: Optional[float] = None
    text = env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    if text is not None and text.strip():
        share = parse_decimal(text)  # ASCII only: "٥٠" is no number to CUDA
        if share is None:
            ignored[ACTIVE_THREADS] = NOT_A_NUMBER
        elif not 0 < share <= 100:  # NaN and the infinities included
            ignored[ACTIVE_THREADS], share = OUT_OF_RANGE, None
    priority: Optional[int] = None
    text = env.get("CUDA_MPS_CLIENT_PRIORITY")
    if text is not None and text.strip():
        digits = text.strip()
        if not (digits.isascii() and digits.isdigit()):  # "²".isdigit(), but no digit to CUDA
            ignored[PRIORITY] = NOT_A_NUMBER
        else:
            # A long string of digits is a large number: out of range, never converted.
            priority = parse_uint(digits, max_digits=3)
            if priority is None or priority > 1:
                ignored[PRIORITY], priority = OUT_OF_RANGE, None
    return OwnLimits(Limits(share, pinned), priority, ignored)


@dataclass(frozen=True)
class InForce:
    limits: Limits
    sources: Mapping[str, str]  # PINNED_MEMORY / ACTIVE_THREADS -> one of SOURCES


def client_limits(own: Limits, server: Optional[Limits], default: Limits,
                  at_connect: Optional[Limits] = None) -> InForce:
    """The limits in force for a client with limits `own`, running on a server with
    `server` now (None: no server known for it), under a daemon with `default`;
    `at_connect`: the server's limits when the client connected, where known."""
    if at_connect is not None:
        inherited, origin = at_connect, SERVER_AT_CONNECT
    elif server is not None:
        inherited, origin = server, SERVER_NOW
    else:
        inherited, origin = default, DAEMON_DEFAULT
    mine, theirs = own.thread_percentage, inherited.thread_percentage
    share: Optional[float] = theirs
    share_source = origin if theirs is not None else NONE
    if mine is not None and (theirs is None or mine <= theirs):
        share, share_source = mine, CLIENT
    pinned = {**inherited.pinned_bytes, **own.pinned_bytes}
    pinned_source = CLIENT if own.pinned_bytes else origin if inherited.pinned_bytes else NONE
    return InForce(Limits(share, pinned), {PINNED_MEMORY: pinned_source, ACTIVE_THREADS: share_source})

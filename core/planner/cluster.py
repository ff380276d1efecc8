"""The cluster a plan is for: nodes x devices of one kind, and the links between them.

Short form: `[NODES x] DEVICES x KIND[,key=value...]`, e.g. `2x8xH200,nvlink=900GB/s,
ib=400Gb/s` or `1x2xcpu`. Keys: `nvlink` / `intra` (bandwidth between devices of a node,
per device and direction), `ib` / `inter` (between nodes, per device), `intra_latency`,
`inter_latency` (per message step), `memory` (per device, overrides the table's).
Bandwidths take B/s or b/s with k, M, G, T prefixes; latencies s, ms, us, ns; sizes B, KB,
MB, GB, TB, KiB, MiB, GiB, TiB. A YAML file says the same with keys `nodes`,
`devices_per_node`, `device`, `intra_node: {bandwidth, latency}`, `inter_node:
{bandwidth, latency}`, `memory`, `shared_host`.

KIND is a device of an installed plugin's hardware table (`tokenmill_hardware_spec` asked
by name: H200, B200, MI300X, TPU v5e ...), or `cpu`: this machine, whose cores and memory
the ranks share (a mix of w ranks gives each 1/w of them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from tokenmill.platforms.interfaces import HardwareSpec

# Per-message latency defaults: a ring step over NVLink-class links (NCCL's small-message
# all-reduce over 8 GPUs is ~10-20 us, 2 (n - 1) = 14 steps), over an RDMA network, and
# over loopback TCP between processes (gloo; `tokenmill plan --calibrate` measures it).
INTRA_LATENCY = 1.5e-6
INTER_LATENCY = 5e-6
HOST_LATENCY = 60e-6
HOST_LINK_BANDWIDTH = 2e9  # loopback TCP between two processes, about


@dataclass(frozen=True, slots=True)
class Link:
    bandwidth: float  # bytes/s per device and direction
    latency: float  # seconds per message step


@dataclass(frozen=True, slots=True)
class Cluster:
    nodes: int
    devices_per_node: int
    kind: str  # as named: "H200", "cpu"
    device: HardwareSpec  # one device's (a shared host: the whole host's)
    plugin: str  # the plugin whose table answered
    intra: Link
    inter: Link
    shared_host: bool = False  # the devices are slices of one host's cores and memory

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def describe(self) -> str:
        return (f"{self.nodes}x{self.devices_per_node}x{self.kind} ({self.device.name}; "
                f"intra {self.intra.bandwidth / 1e9:.0f} GB/s, inter "
                f"{self.inter.bandwidth / 1e9:.0f} GB/s)")


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_bandwidth(text: str) -> float:
    """"900GB/s" -> 9e11 bytes/s, "400Gb/s" -> 5e10 (bits / 8)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)([bB])(?:ps|/s)\s*", str(text))
    if not m:
        raise ValueError(f"bandwidth {text!r}: write it like 900GB/s or 400Gb/s")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    return value / 8 if m.group(3) == "b" else value


def parse_latency(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+)\s*(s|ms|us|µs|ns)\s*", str(text))
    if not m:
        raise ValueError(f"latency {text!r}: write it like 2us, 0.5ms or 50ns")
    return float(m.group(1)) * _TIME[m.group(2)]


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]i?)?[bB]\s*", str(text))
    if not m:
        raise ValueError(f"size {text!r}: write it like 141GB or 80GiB")
    unit = (m.group(2) or "").lower()
    return int(float(m.group(1)) * (_BINARY.get(unit + "b") or _UNITS[unit[:1]]))


def parse_cluster(text: str) -> Cluster:
    """A `Cluster` from the short form or a YAML file's path (module docstring)."""
    path = Path(text)
    if path.suffix in (".yaml", ".yml") or (path.is_file() and "x" not in path.name):
        return _from_yaml(path)
    head, *options = [part.strip() for part in text.split(",")]
    sizes = head.split("x", 2) if head.count("x") >= 2 else ["1", *head.split("x", 1)]
    try:
        nodes, per_node, kind = int(sizes[0]), int(sizes[1]), sizes[2]
    except (ValueError, IndexError):
        raise ValueError(
            f"cluster {text!r}: write NODESxDEVICESxKIND[,nvlink=..,ib=..], e.g. "
            "2x8xH200,nvlink=900GB/s,ib=400Gb/s, or a YAML file") from None
    keys = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise ValueError(f"cluster option {option!r} needs key=value")
        keys[key.strip().lower()] = value.strip()
    return build_cluster(nodes, per_node, kind, keys)


def _from_yaml(path: Path) -> Cluster:
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict) or "device" not in data:
        raise ValueError(f"{path}: a cluster YAML needs at least 'device' (and 'nodes', "
                         "'devices_per_node')")
    keys: dict[str, str] = {}
    for section, prefix in (("intra_node", "intra"), ("inter_node", "inter")):
        link = data.get(section) or {}
        if "bandwidth" in link:
            keys[prefix] = str(link["bandwidth"])
        if "latency" in link:
            keys[f"{prefix}_latency"] = str(link["latency"])
    for key in ("memory", "shared_host"):
        if key in data:
            keys[key] = str(data[key])
    return build_cluster(int(data.get("nodes", 1)), int(data.get("devices_per_node", 1)),
                         str(data["device"]), keys)


_ALIASES = {"nvlink": "intra", "xgmi": "intra", "ici": "intra", "ib": "inter", "net": "inter"}
_KNOWN = {"intra", "inter", "intra_latency", "inter_latency", "memory", "shared_host"}


def build_cluster(nodes: int, per_node: int, kind: str, keys: dict[str, str]) -> Cluster:
    from tokenmill.platforms.registry import device_spec

    keys = {_ALIASES.get(k, k): v for k, v in keys.items()}
    unknown = set(keys) - _KNOWN
    if unknown:
        raise ValueError(f"unknown cluster option(s) {sorted(unknown)}; known: "
                         f"{sorted(_KNOWN | set(_ALIASES))}")
    if nodes < 1 or per_node < 1:
        raise ValueError(f"a cluster of {nodes} x {per_node} devices is empty")
    plugin, spec = device_spec(kind)
    if "memory" in keys:
        spec = replace(spec, memory_bytes=parse_size(keys["memory"]))
    shared = keys.get("shared_host", str(kind.lower() == "cpu")).lower() in ("1", "true", "yes")
    if shared:
        intra = Link(HOST_LINK_BANDWIDTH, HOST_LATENCY)
    else:
        intra = Link(spec.link_bandwidth or 50e9, INTRA_LATENCY)
    if "intra" in keys:
        intra = replace(intra, bandwidth=parse_bandwidth(keys["intra"]))
    if "intra_latency" in keys:
        intra = replace(intra, latency=parse_latency(keys["intra_latency"]))
    inter = Link(parse_bandwidth(keys.get("inter", "400Gb/s")),
                 parse_latency(keys.get("inter_latency", f"{INTER_LATENCY * 1e6}us")))
    return Cluster(nodes, per_node, kind, spec, plugin, intra, inter, shared)

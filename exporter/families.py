"""Build fresh metric families for one scrape, checked against the contract.

Usage in a collector:

    out = FamilyBuilder()
    out.add("mps_gpu_up", 1, gpu="0", uuid="GPU-...")
    out.add_histogram("mps_client_queue_wait_seconds", counts, total, daemon="default", reason="user_switch")
    return out.families()

A family appears in the output only if at least one sample was added. `None`
values are skipped (the series is absent, never a made-up number).
"""

from __future__ import annotations

import math
from typing import Dict, FrozenSet, List, Optional, Protocol, Sequence, Tuple

from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from .contract import COUNTER, DECLARED, HISTOGRAM, MAX_LABEL_CHARS, MetricSpec


class ContractError(ValueError):
    """A sample does not match the metric contract (a programming error)."""


def _family_name(spec: MetricSpec) -> str:
    # client_python wants counter families named without the _total suffix.
    if spec.type == COUNTER and spec.name.endswith("_total"):
        return spec.name[: -len("_total")]
    return spec.name


def empty_family(spec: MetricSpec) -> Metric:
    """The family of this spec without samples: what a collector's describe() returns."""
    return Metric(_family_name(spec), spec.help, spec.type)


def _check_labels(spec: MetricSpec, labels: Dict[str, object]) -> None:
    if labels.keys() != spec.label_set:
        raise ContractError(f"{spec.name}: labels {sorted(labels)} != contract {sorted(spec.labels)}")


def _label_values(labels: Dict[str, object], cut: FrozenSet[str] = frozenset()) -> Dict[str, str]:
    """Label values as strings; those in `cut` (taken from input) at most MAX_LABEL_CHARS long."""
    out = {k: v if type(v) is str else ("" if v is None else str(v)) for k, v in labels.items()}
    for k in cut:
        if len(out[k]) > MAX_LABEL_CHARS:
            out[k] = out[k][:MAX_LABEL_CHARS]
    return out


class SeriesSink(Protocol):
    """Where a render adds its series: a FamilyBuilder, or a SeriesRecorder."""

    def add(self, name: str, value: Optional[float], /, **labels: object) -> None: ...

    def add_histogram(self, name: str, bucket_counts: Sequence[Tuple[float, float]], total: float, /,
                      **labels: object) -> None: ...


class FamilyBuilder:
    """The samples of each family by declared name, in the order of their first sample;
    client_python's family objects are made when `families()` asks (a builder of one
    client's series, `parts`, needs none)."""

    def __init__(self) -> None:
        self._samples: Dict[str, Tuple[MetricSpec, List[Sample]]] = {}
        self._metrics: Dict[str, Metric] = {}

    def _family(self, name: str) -> Tuple[MetricSpec, List[Sample]]:
        found = self._samples.get(name)
        if found is None:
            spec = DECLARED.get(name)
            if spec is None:
                raise ContractError(f"{name} is not declared (contract.table)")
            found = self._samples[name] = (spec, [])
        return found

    def add(self, name: str, value: Optional[float], /, **labels: object) -> None:
        # The hot path of a scrape (hundreds of calls): keep it lean.
        if value is None:
            return
        spec, samples = self._family(name)
        if spec.type == HISTOGRAM:
            raise ContractError(f"{name} is a histogram: use add_histogram")
        value = float(value)
        if value != value:  # NaN: no number to publish
            return
        _check_labels(spec, labels)
        samples.append(Sample(spec.name, _label_values(labels, spec.input_labels), value, None))

    def add_histogram(self, name: str, bucket_counts: Sequence[Tuple[float, float]], total: float, /, **labels: object) -> None:
        """bucket_counts: (upper bound, cumulative count) pairs ending with +Inf."""
        spec, samples = self._family(name)
        if spec.type != HISTOGRAM:
            raise ContractError(f"{name} is not a histogram")
        _check_labels(spec, labels)
        base = _label_values(labels, spec.input_labels)
        count = 0.0
        for bound, cumulative in bucket_counts:
            le = "+Inf" if math.isinf(bound) else _format_le(bound)
            samples.append(Sample(spec.name + "_bucket", {**base, "le": le}, float(cumulative), None))
            count = float(cumulative)
        samples.append(Sample(spec.name + "_count", base, count, None))
        samples.append(Sample(spec.name + "_sum", base, float(total), None))

    def families(self) -> List[Metric]:
        out = []
        for name, (spec, samples) in self._samples.items():
            if not samples:
                continue
            fam = self._metrics.get(name)
            if fam is None:
                fam = self._metrics[name] = empty_family(spec)
                fam.samples = samples  # the same list: samples added later are in it too
            out.append(fam)
        return out

    def parts(self) -> List[Tuple[str, List[Sample]]]:
        """(declared name, samples) of each family with samples: what `extend` takes back."""
        return [(name, samples) for name, (_, samples) in self._samples.items() if samples]

    def last(self, name: str) -> Sample:
        """The sample last added to the family."""
        return self._samples[name][1][-1]

    def extend(self, name: str, samples: Sequence[Sample]) -> None:
        """Samples built and checked by an earlier builder (`parts`), added as they are."""
        self._family(name)[1].extend(samples)


# A recorded family's series: each one's labels (and a histogram's bounds) in the order added.
_Shape = Tuple[Tuple[str, Tuple[object, ...]], ...]


class SeriesRecorder:
    """What a render adds to a FamilyBuilder, kept as its shape (each family's series, in
    the order a FamilyBuilder gives them) and its values in that order, without samples,
    label checks or families: the exporter's own series, whose values move in every scrape
    and whose series hardly ever do (collector.Exposition writes them by shape). The
    same values skipped: None and NaN."""

    def __init__(self) -> None:
        self._series: Dict[str, List[object]] = {}
        self._values: Dict[str, List[float]] = {}

    def _family(self, name: str) -> Tuple[List[object], List[float]]:
        series = self._series.get(name)
        if series is None:
            series = self._series[name] = []
            self._values[name] = []
        return series, self._values[name]

    def add(self, name: str, value: Optional[float], /, **labels: object) -> None:
        if value is None:
            return
        value = float(value)
        if value != value:
            return
        series, values = self._family(name)
        series.append(tuple(labels.items()))
        values.append(value)

    def add_histogram(self, name: str, bucket_counts: Sequence[Tuple[float, float]], total: float, /,
                      **labels: object) -> None:
        series, values = self._family(name)
        series.append((tuple(labels.items()), tuple(bound for bound, _ in bucket_counts)))
        count = 0.0
        for _, cumulative in bucket_counts:  # the buckets, _count, _sum: FamilyBuilder's order
            count = float(cumulative)
            values.append(count)
        values.append(count)
        values.append(float(total))

    def shape(self) -> _Shape:
        return tuple((name, tuple(series)) for name, series in self._series.items())

    def values(self) -> List[float]:
        return [value for values in self._values.values() for value in values]


def _format_le(bound: float) -> str:
    # Same spelling client_python uses for its own histograms ("0.05", "1.0").
    return repr(float(bound))

"""The optional sampling parameters, declared once for the gateway and the engine.

`SamplingKnobs` is the table: one dataclass field per optional sampling parameter, with
the value an unset parameter means, its type, its range and a one-line description
(`knob(...)`). Each hop reads the table instead of listing the parameters again:

- gateway, `api/schemas.py`: the request body's field of the same name (None when left
  out), bounded by the range (with OpenAI's tighter `api_le` where there is one);
- gateway, `clients/engine.py`: each value the client set goes into the proto `SamplingParams`
  field of the same name (an `optional` field, so "unset" survives the wire);
- engine, `servicer.py`: each proto field that is set goes into the engine's
  `SamplingParams`, which inherits these fields (and their defaults) and checks them
  against the same ranges (`knob_problem`).

So a new optional parameter is a proto field, a line here, and the engine code that
uses it (docs/api.md, "Adding a sampling parameter").
"""

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
UINT32_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_TOP_LOGPROBS = 20
"""Most alternatives per position of top_logprobs and prompt_logprobs (OpenAI's bound)."""
MAX_NUM_SAMPLES = 128
"""Most samples (`n`) of one request an engine takes (detok refuses more before it opens
the engine's stream)."""
MAX_BAD_WORDS = 64
"""Most bad_words of one request (each is at most two token sequences for the engine)."""
MAX_BAD_WORD_TOKENS = 32
"""Most tokens of one bad word's sequence."""
MAX_BAD_WORD_CHARS = 512
"""Most characters of one bad word (checked before it is tokenized)."""


@dataclass(frozen=True, slots=True)
class KnobSpec:
    """A parameter's type, range and description. Bounds: ge / gt below, le above;
    `api_le` is a tighter upper bound the OpenAI API adds (the engine accepts up to le)."""

    type: type
    doc: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    api_le: float | None = None

    def problem(self, value: Any) -> str | None:
        """What is wrong with `value` for the engine ("must be in [0, 1], got 2"), or None."""
        if value is None:
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        low_ok = (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
        if low_ok and (self.le is None or value <= self.le):
            return None
        return f"must be in {self.range_text}, got {value}"

    @property
    def range_text(self) -> str:
        low = f"[{self.ge:g}" if self.ge is not None else (
            f"({self.gt:g}" if self.gt is not None else "(-inf")
        high = f"{self.le:g}]" if self.le is not None else "inf)"
        return f"{low}, {high}"


def knob(type_: type, default: Any, doc: str, **bounds: float) -> Any:
    """A table entry: a dataclass field whose metadata is its KnobSpec."""
    return field(default=default, metadata={"knob": KnobSpec(type_, doc, **bounds)})


@dataclass(slots=True)
class SamplingKnobs:
    """The optional sampling parameters and what each means when unset (OpenAI's defaults,
    vLLM's names). A knob's default is its neutral value: a row with it is left as it is,
    which is how the engine's sampler skips a knob no row of a step uses."""

    temperature: float = knob(float, 1.0, "Softmax temperature; 0 means greedy.",
                              ge=0.0, le=FLOAT32_MAX, api_le=2.0)
    top_p: float = knob(float, 1.0, "Nucleus sampling: keep the smallest set of tokens whose "
                        "probability mass reaches top_p.", gt=0.0, le=1.0)
    top_k: int = knob(int, 0, "Keep the k most likely tokens; 0 or -1 keeps all.",
                      ge=-1, le=INT32_MAX)
    min_p: float = knob(float, 0.0, "Drop tokens below min_p times the top token's "
                        "probability.", ge=0.0, le=1.0)
    seed: int | None = knob(int, None, "Seed for reproducible sampling.",
                            ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = knob(float, 0.0, "Subtracted once from the logit of every "
                                   "token already in the output.", ge=-2.0, le=2.0)
    frequency_penalty: float = knob(float, 0.0, "Subtracted from a token's logit per time "
                                    "it is already in the output.", ge=-2.0, le=2.0)
    repetition_penalty: float = knob(float, 1.0, "Divides the positive (multiplies the "
                                     "negative) logits of tokens seen in the prompt or "
                                     "output; 1 is off.", gt=0.0, le=FLOAT32_MAX)


@dataclass(frozen=True, slots=True)
class Knob:
    """One row of the table."""

    name: str
    default: Any
    spec: KnobSpec


KNOBS: tuple[Knob, ...] = tuple(
    Knob(f.name, None if f.default is MISSING else f.default, f.metadata["knob"])
    for f in fields(SamplingKnobs))
"""The table's rows, in declaration order."""

DEFAULTS: dict[str, Any] = {row.name: row.default for row in KNOBS}
"""Each knob's default (neutral) value, by name."""


def knob_problem(values: Any) -> str | None:
    """The first knob of `values` (an object with the knobs as attributes) out of range,
    as "name must be ...", or None when every one is fine."""
    for row in KNOBS:
        problem = row.spec.problem(getattr(values, row.name))
        if problem is not None:
            return f"{row.name} {problem}"
    return None


def sample_seed(seed: int, index: int) -> int:
    """The seed sample `index` of an n > 1 request draws with: seed + index, wrapped to
    int64 (vLLM's rule). The engine fans a seeded request out with it, and the gateway
    gives it to a sample it resubmits alone, so both draw the same."""
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN

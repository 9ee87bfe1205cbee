"""One sample's text stream: token ids in, text deltas and a stop match out."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.detok.decode_options import DecodeOptions
from conveyor.detok.detokenizer import Detokenizer
from conveyor.detok.errors import InvalidStreamError
from conveyor.detok.stop_matcher import StopHit, StopMatcher
from conveyor.detok.tool_call_stream import ToolCallDelta, ToolCallOptions, ToolCallStream


@dataclass(frozen=True, slots=True)
class StreamStart:
    """The options a stream is opened with."""

    request_id: str = ""
    prompt_tail_ids: list[int] = field(default_factory=list)
    stops: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    options: DecodeOptions = DecodeOptions()
    tool_calls: ToolCallOptions | None = None
    """Read tool calls out of the text (None: the text is all content)."""


@dataclass(frozen=True, slots=True)
class StopMatch:
    """Which stop string ended the text, and after how many output tokens."""

    stop: str
    stop_index: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class StreamOutput:
    """What one caller message produced: new content text, and with tool-call parsing
    the pieces of tool calls."""

    text: str
    num_tokens: int
    stop_match: StopMatch | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.text and self.stop_match is None and not self.tool_calls


class DetokenizeStream:
    """Detokenizer, stop matcher and (when asked) tool-call reader for one request.

    Tokens are taken one at a time, so a stop match names the exact token
    that completed it; tokens after a match are ignored. Once `is_finished`
    (a stop matched or `finish` was called) the stream takes nothing more.
    Tool calls are read from the text the stop matcher lets through; the text is
    whole at a stop match or at `finish`.
    """

    def __init__(self, tokenizer, start: StreamStart):
        self._vocab_size = len(tokenizer)
        _check_stops(start.stops)
        check_ids(start.prompt_tail_ids, self._vocab_size, "prompt_tail_ids")
        self._detokenizer = Detokenizer(tokenizer, start.options, start.prompt_tail_ids)
        self._stop = StopMatcher(start.stops, start.include_stop_str_in_output)
        self._tools = (ToolCallStream(start.tool_calls, start.request_id)
                       if start.tool_calls is not None else None)
        self._num_tokens = 0
        self.is_finished = False

    def feed(self, token_ids: list[int]) -> StreamOutput:
        """Add output tokens; return the text that became final."""
        self._check_open()
        check_ids(token_ids, self._vocab_size, "token_ids")
        pieces: list[str] = []
        for token_id in token_ids:
            self._num_tokens += 1
            text, hit = self._stop.push(self._detokenizer.append(token_id))
            pieces.append(text)
            if hit is not None:
                return self._stopped("".join(pieces), hit)
        return self._output("".join(pieces))

    def finish(self) -> StreamOutput:
        """The engine finished without a stop string: flush all held-back text."""
        self._check_open()
        text, hit = self._stop.push(self._detokenizer.flush())
        if hit is not None:
            return self._stopped(text, hit)
        self.is_finished = True
        return self._output(text + self._stop.flush())

    def _stopped(self, text: str, hit: StopHit) -> StreamOutput:
        self.is_finished = True
        return self._output(text, StopMatch(hit.stop, hit.index, self._num_tokens))

    def _output(self, text: str, stop_match: StopMatch | None = None) -> StreamOutput:
        """The output of `text`, through the tool-call reader when there is one."""
        if self._tools is None:
            return StreamOutput(text, self._num_tokens, stop_match)
        content, calls = self._tools.push(text, final=self.is_finished)
        return StreamOutput(content, self._num_tokens, stop_match, tuple(calls))

    def _check_open(self) -> None:
        if self.is_finished:
            raise InvalidStreamError("the stream already finished; open a new one")


def check_ids(token_ids: list[int], vocab_size: int, name: str, first: int = 0) -> None:
    """InvalidStreamError naming `name` and the position (`first` + its index) of an id
    outside the vocabulary."""
    for position, token_id in enumerate(token_ids):
        if token_id >= vocab_size:
            raise InvalidStreamError(
                f"{name}[{first + position}] = {token_id} is outside the vocabulary "
                f"(ids must be below {vocab_size})"
            )


def _check_stops(stops: list[str]) -> None:
    for index, stop in enumerate(stops):
        if not stop:
            raise InvalidStreamError(
                f"stop[{index}] is empty; stop strings need at least one character"
            )

"""The text of one generation: each sample's DetokenizeStream, fed the engine's chunks.

A resumed generation (the caller's stream broke, and it opened a new one with the tokens
it had) decodes those tokens first, and holds back the text the caller already has of
them (`KnownText`): detokenization, stop strings and tool-call reading are
deterministic, so the new stream's text starts with the old one's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from conveyor.detok.errors import InvalidStreamError
from conveyor.detok.stream import DetokenizeStream, StreamOutput, StreamStart, check_ids
from conveyor.detok.tool_call_stream import ToolCallDelta

PROMPT_TAIL_TOKENS = 6
"""Prompt tokens decoded before the output, for its first token's leading space and
UTF-8 context (never emitted)."""


@dataclass(frozen=True, slots=True)
class SampleText:
    """What one chunk of a sample became: new content and tool-call pieces, how many of
    the chunk's tokens count (those after a stop string's match do not), the sample's
    output tokens so far (resumed ones included), and the stop string that ended the
    sample (None: not ended by one)."""

    text: str
    tool_calls: tuple[ToolCallDelta, ...]
    num_tokens: int
    num_output_tokens: int
    stop: str | None = None


class KnownText:
    """The text a caller already has (`num_chars` of content, and the arguments'
    characters of each tool call it has the header of), held back from what comes."""

    def __init__(self, num_chars: int = 0, argument_chars: list[int] | None = None):
        self._num_chars = num_chars
        self._argument_chars = list(argument_chars or [])

    def fresh(self, output: StreamOutput) -> StreamOutput:
        """`output` without what the caller has."""
        cut = min(len(output.text), self._num_chars)
        self._num_chars -= cut
        calls = tuple(fresh for delta in output.tool_calls
                      if (fresh := self._fresh_call(delta)) is not None)
        return replace(output, text=output.text[cut:], tool_calls=calls)

    def _fresh_call(self, delta: ToolCallDelta) -> ToolCallDelta | None:
        """`delta` without what the caller has: a header it has is not sent again (its
        arguments, past what the caller has of them, go on as a fragment)."""
        if delta.index >= len(self._argument_chars):
            return delta
        cut = min(len(delta.arguments), self._argument_chars[delta.index])
        self._argument_chars[delta.index] -= cut
        if cut == len(delta.arguments):
            return None
        return ToolCallDelta(delta.index, arguments=delta.arguments[cut:])


class TextGeneration:
    """The n samples of one request, each with its own stream (its tool calls named after
    its id in `sample_ids`). `push` takes a chunk of one sample; `is_finished` once every
    sample has finished (the engine's finish, or a stop string)."""

    def __init__(self, tokenizer, start: StreamStart, prompt_ids: list[int],
                 sample_ids: list[str], resumed_ids: list[int] | None = None,
                 known: KnownText | None = None):
        tail = prompt_ids[-PROMPT_TAIL_TOKENS:]
        check_ids(tail, len(tokenizer), "generate.prompt_token_ids", len(prompt_ids) - len(tail))
        self._streams = [DetokenizeStream(tokenizer, replace(start, request_id=sample_id,
                                                             prompt_tail_ids=tail))
                         for sample_id in sample_ids]
        self._known = [None] * len(sample_ids)
        self._num_tokens = [0] * len(sample_ids)
        self._held: StreamOutput | None = None
        """The text of the resumed tokens the caller does not have yet (their text was
        held back when its stream broke): it goes out with the first chunk."""
        if resumed_ids:
            if len(sample_ids) != 1:
                raise InvalidStreamError("a resumed generation has one sample (n = 1)")
            check_ids(resumed_ids, len(tokenizer), "generate.resume_output_token_ids")
            self._known[0] = known or KnownText()
            self._held = self._known[0].fresh(self._streams[0].feed(resumed_ids))
            if self._streams[0].is_finished:
                raise InvalidStreamError("generate.resume_output_token_ids already end at a "
                                         "stop string: there is nothing to resume")
            self._num_tokens[0] = len(resumed_ids)
        elif known is not None:
            raise InvalidStreamError("text_so_far is only for a resumed generation "
                                     "(generate.resume_output_token_ids)")

    @property
    def is_finished(self) -> bool:
        return all(stream.is_finished for stream in self._streams)

    def push(self, index: int, token_ids: list[int], finished: bool) -> SampleText | None:
        """The text of sample `index`'s next tokens (`finished`: its last chunk, so held
        text is flushed); None when that sample already ended at a stop string."""
        stream = self._stream(index)
        if stream.is_finished:
            return None
        output = stream.feed(token_ids)
        if finished and not stream.is_finished:
            flushed = stream.finish()
            output = StreamOutput(output.text + flushed.text, flushed.num_tokens,
                                  flushed.stop_match, output.tool_calls + flushed.tool_calls)
        if self._known[index] is not None:
            output = self._known[index].fresh(output)
        if self._held is not None and index == 0:
            output = replace(output, text=self._held.text + output.text,
                             tool_calls=self._held.tool_calls + output.tool_calls)
            self._held = None
        num_before, self._num_tokens[index] = self._num_tokens[index], output.num_tokens
        stop = output.stop_match.stop if output.stop_match is not None else None
        return SampleText(output.text, output.tool_calls, output.num_tokens - num_before,
                          output.num_tokens, stop)

    def _stream(self, index: int) -> DetokenizeStream:
        if index >= len(self._streams):
            raise InvalidStreamError(f"the engine sent sample {index} of "
                                     f"{len(self._streams)}")
        return self._streams[index]

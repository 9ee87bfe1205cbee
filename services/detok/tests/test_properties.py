"""Property tests with the real SmolLM2 tokenizer: deltas add up to the full
decode, nothing is taken back, stop strings never leak."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.detok.decode_options import DecodeOptions, decode_full
from conveyor.detok.stream import DetokenizeStream, StreamStart

VOCAB_SIZE = 49152
PROPERTY_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

token_ids = st.one_of(
    st.integers(0, 16),  # added tokens, all special
    st.integers(17, 272),  # single bytes: split UTF-8 characters
    st.integers(0, VOCAB_SIZE - 1),
)
options = st.builds(DecodeOptions, st.booleans(), st.booleans())
unicode_text = st.text(
    st.one_of(
        st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK
        st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),  # emoji
        st.characters(min_codepoint=0x0300, max_codepoint=0x036F),  # combining marks
        st.sampled_from("ab \n.\u200d\ufe0f"),
        st.characters(codec="utf-8", exclude_categories=("Cs",)),
    ),
    max_size=40,
)


def chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    chunks, at = [], 0
    for size in sizes:
        chunks.append(ids[at:at + size])
        at += size
    return [*chunks, ids[at:]]


def run_stream(tokenizer, start: StreamStart, chunks: list[list[int]]):
    """Feed chunks; assert the running text only ever grows towards `final`."""
    stream, text, outputs = DetokenizeStream(tokenizer, start), "", []
    for chunk in chunks:
        outputs.append(stream.feed(chunk))
        text += outputs[-1].text
        if stream.is_finished:
            return text, outputs
    outputs.append(stream.finish())
    return text + outputs[-1].text, outputs


@PROPERTY_SETTINGS
@given(ids=st.lists(token_ids, max_size=40), prompt=st.lists(token_ids, max_size=8),
       opts=options, sizes=st.lists(st.integers(0, 5), max_size=10))
def test_random_token_sequences_add_up_to_the_full_decode(tokenizer, ids, prompt, opts, sizes):
    full = decode_full(tokenizer, ids, opts)
    start = StreamStart(prompt_tail_ids=prompt, options=opts)
    text, outputs = run_stream(tokenizer, start, chunked(ids, sizes))
    assert text == full
    running = ""
    for output in outputs:
        running += output.text
        assert full.startswith(running)  # nothing is ever taken back


@PROPERTY_SETTINGS
@given(text=unicode_text, prompt_text=unicode_text, sizes=st.lists(st.integers(1, 4), max_size=8))
def test_random_unicode_text_streams_back_exactly(tokenizer, text, prompt_text, sizes):
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode(prompt_text)[-6:]
    start = StreamStart(prompt_tail_ids=prompt, options=DecodeOptions())
    streamed, _ = run_stream(tokenizer, start, chunked(ids, sizes))
    # Not always == text: bytes missing from the vocabulary (0xF1..) are lost by encode.
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True)


@PROPERTY_SETTINGS
@given(text=unicode_text, data=st.data(), include=st.booleans(),
       sizes=st.lists(st.integers(1, 3), max_size=12))
def test_stop_strings_never_leak_and_cut_at_the_first_match(tokenizer, text, data, include, sizes):
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stops = data.draw(st.lists(_stop_strings(full), min_size=1, max_size=3))
    start = StreamStart(stops=stops, include_stop_str_in_output=include)
    streamed, outputs = run_stream(tokenizer, start, chunked(ids, sizes))
    expected, hit = _reference(full, stops, include)
    assert streamed == expected
    if not include:
        assert not any(stop in streamed for stop in stops)
    match = outputs[-1].stop_match
    assert (match.stop if match else None) == hit
    if match:
        assert stops[match.stop_index] == match.stop
        assert 1 <= match.num_tokens <= len(ids)
        assert decode_prefix(tokenizer, ids, match.num_tokens).find(match.stop) >= 0


def decode_prefix(tokenizer, ids: list[int], num_tokens: int) -> str:
    return tokenizer.decode(ids[:num_tokens], skip_special_tokens=True)


def _stop_strings(full: str):
    """Substrings of the text (so stops do match) and short random strings."""
    if not full:
        return st.text(st.sampled_from("ab😀你"), min_size=1, max_size=3)
    span = st.tuples(st.integers(0, len(full) - 1), st.integers(1, 4))
    from_text = span.map(lambda s: full[s[0]:s[0] + s[1]])
    return st.one_of(from_text, st.text(st.sampled_from("ab 😀你"), min_size=1, max_size=3))


def _reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    hits = [(text.find(s) + len(s), text.find(s), i) for i, s in enumerate(stops) if s in text]
    if not hits:
        return text, None
    end, start, index = min(hits)
    return (text[:end] if include else text[:start]), stops[index]

"""The gateway's spans: one SERVER span per HTTP request, the root of the request's trace
(the tokenizer / engine / detok RPC spans descend from it), and under it the generation's
GenAI span, finished once the response is out."""

from __future__ import annotations

from opentelemetry.trace import SpanKind

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def _named(span_exporter, name):
    return [s for s in span_exporter.get_finished_spans() if s.name == name]


def _request_spans(span_exporter, name):
    return [s for s in span_exporter.get_finished_spans()
            if s.name == name and s.kind is SpanKind.SERVER]


async def _post(gateway, path, body):
    async with gateway.client() as client:
        if not body.get("stream"):
            return await client.post(path, json=body)
        async with client.stream("POST", path, json=body) as response:
            await response.aread()
            return response


async def test_a_streamed_chat_is_one_trace_rooted_at_the_gateway(gateway, span_exporter,
                                                                  wait_until):
    span_exporter.clear()
    response = await _post(gateway, "/v1/chat/completions", {**CHAT, "stream": True})
    assert response.status_code == 200
    await wait_until(lambda: _named(span_exporter, "chat fake-model"))  # ends after settling
    [root] = _request_spans(span_exporter, "POST /v1/chat/completions")
    assert root.parent is None and root.attributes["http.response.status_code"] == 200
    [generation] = _named(span_exporter, "chat fake-model")
    assert generation.parent.span_id == root.context.span_id
    assert dict(generation.attributes) | {"gen_ai.response.finish_reasons": None} == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "fake-model", "gen_ai.request.max_tokens": 5,
        "gen_ai.usage.input_tokens": len("user:hi\nassistant:"),
        "gen_ai.usage.output_tokens": 5, "gen_ai.response.finish_reasons": None,
        "conveyor.request.id": response.headers["x-request-id"],
        "conveyor.usage.cached_tokens": 3,
        "conveyor.engine.id": response.headers["x-conveyor-engine"],
    }
    assert tuple(generation.attributes["gen_ai.response.finish_reasons"]) == ("length",)
    in_trace = {s.name for s in span_exporter.get_finished_spans()
                if s.context.trace_id == root.context.trace_id}
    assert {"conveyor.v1.Tokenizer/Render", "conveyor.v1.Engine/Generate",
            "conveyor.v1.Detokenizer/Generate"} <= in_trace


async def test_completions_are_text_completion_and_client_trace_context_is_kept(
        gateway, span_exporter, wait_until):
    span_exporter.clear()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    async with gateway.client() as client:
        response = await client.post(
            "/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 2},
            headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    assert response.status_code == 200
    await wait_until(lambda: _named(span_exporter, "text_completion fake-model"))
    [root] = _request_spans(span_exporter, "POST /v1/completions")
    assert f"{root.context.trace_id:032x}" == trace_id
    [generation] = _named(span_exporter, "text_completion fake-model")
    assert generation.context.trace_id == root.context.trace_id
    assert generation.attributes["gen_ai.usage.output_tokens"] == 2


async def test_a_refused_request_has_a_root_span_but_no_generation(gateway, span_exporter,
                                                                  wait_until):
    span_exporter.clear()
    response = await _post(gateway, "/v1/chat/completions", {**CHAT, "model": "other"})
    assert response.status_code == 404
    await wait_until(lambda: _request_spans(span_exporter, "POST /v1/chat/completions"))
    [root] = _request_spans(span_exporter, "POST /v1/chat/completions")
    assert root.attributes["http.response.status_code"] == 404
    assert not [s for s in span_exporter.get_finished_spans() if " " in s.name
                and s.name.split()[0] in ("chat", "text_completion")]

"""LMI formatters, byte for byte on the wire, from hand-built engine outputs (no model, no
server): the protocol's objects, framed and given statuses as the server does."""

from __future__ import annotations

import orjson
import pytest

from handlers.engine.types import (
    FinishReason,
    RequestMetrics,
    RequestOutput,
    SequenceOutput,
    Token,
    TopToken,
)
from handlers.protocols.lmi import (
    LmiError,
    LmiFailure,
    RenderOptions,
    StreamRenderer,
    StreamStyle,
    answer_style,
    early_failure,
    parse_lmi_request,
    render_json,
    stream_style,
)
from handlers.protocols.outputs import Event, Folded
from handlers.server.framing import LMI_FRAMING
from handlers.server.status import LMI_HTTP

PROMPT = "What is"
LMI_ERROR_LINE = (
    b'{"token":{"id":-1,"text":"","log_prob":-1,"special_token":true},"generated_text":"",'
    b'"details":{"finish_reason":"error","generated_tokens":null,"inputs":null}}\n'
)


def tok(id: int, text: str, logprob: float | None = -0.5, **kw) -> Token:
    return Token(id=id, text=text, logprob=logprob, **kw)


def seq(tokens, reason=None, index=0, cum=0.0, error=None) -> SequenceOutput:
    return SequenceOutput(index, list(tokens), reason, error, cum, len(tokens))


def out(*seqs: SequenceOutput, finished=None, prompt_logprobs=None) -> RequestOutput:
    done = all(s.finished for s in seqs) if finished is None else finished
    metrics = RequestMetrics(arrival_time=0.0)
    return RequestOutput("r1", list(seqs), 2, metrics, done, prompt_logprobs)


def opts(**kw) -> RenderOptions:
    return RenderOptions(inputs=PROMPT, **kw)


def error_answer(failure: LmiFailure) -> tuple[int, bytes]:
    status = LMI_HTTP[failure.kind]
    return status, orjson.dumps(failure.payload(status))


def complete(*outputs: RequestOutput, **kw) -> tuple[int, bytes]:
    acc = Folded()
    for output in outputs:
        acc.add(output)
    try:
        return 200, orjson.dumps(render_json(acc, opts(**kw)))
    except LmiFailure as failure:
        return error_answer(failure)


def framed(style: StreamStyle, events: list[Event] | Event) -> bytes:
    events = [events] if isinstance(events, Event) else events
    return b"".join(LMI_FRAMING[style].frame(event.data) for event in events)


def stream(style: StreamStyle, *outputs: RequestOutput, **kw) -> list[bytes]:
    renderer = StreamRenderer(opts(**kw), style)
    return [framed(style, renderer.feed(o)) for o in outputs]


DEEP = tok(5, " Deep", -0.25)
LEARNING = tok(6, " learning", -0.5)
TWO_STEPS = (out(seq([DEEP])), out(seq([LEARNING], FinishReason.LENGTH)))


# --- non-streaming json ---------------------------------------------------------------------


def test_json_without_details_is_generated_text_only():
    assert complete(*TWO_STEPS) == (200, b'{"generated_text":" Deep learning"}')


def test_json_details_list_tokens_in_djl_key_order():
    status, body = complete(*TWO_STEPS, details=True)
    assert status == 200
    assert body == (
        b'{"generated_text":" Deep learning","details":{"finish_reason":"length",'
        b'"generated_tokens":2,"inputs":"What is","tokens":['
        b'{"id":5,"text":" Deep","log_prob":-0.25},{"id":6,"text":" learning","log_prob":-0.5}]}}'
    )


def test_json_return_full_text_prepends_the_prompt():
    assert complete(*TWO_STEPS, return_full_text=True) == (
        200,
        b'{"generated_text":"What is Deep learning"}',
    )


def test_json_special_token_is_marked_only_when_special():
    eos = tok(2, "", -0.1, special=True)
    _, body = complete(out(seq([DEEP, eos], FinishReason.EOS)), details=True)
    assert b'{"id":2,"text":"","log_prob":-0.1,"special_token":true}' in body
    assert b'{"id":5,"text":" Deep","log_prob":-0.25}' in body
    assert b'"finish_reason":"eos_token"' in body


def test_json_prefill_lists_prompt_tokens():
    prompt = [tok(1, "What", None), tok(2, " is", -3.0)]
    first = out(seq([DEEP], FinishReason.STOP), prompt_logprobs=prompt)
    _, body = complete(first, details=True, prefill=True)
    assert body == (
        b'{"generated_text":" Deep","details":{"finish_reason":"stop_sequence",'
        b'"generated_tokens":1,"inputs":"What is",'
        b'"tokens":[{"id":5,"text":" Deep","log_prob":-0.25}],'
        b'"prefill":[{"id":1,"text":"What","log_prob":null},'
        b'{"id":2,"text":" is","log_prob":-3.0}]}}'
    )


def test_json_top_tokens_per_generated_token():
    top = [TopToken(5, " Deep", -0.25), TopToken(9, " Wide", -2.0)]
    one = tok(5, " Deep", -0.25, top=top)
    _, body = complete(out(seq([one], FinishReason.LENGTH)), details=True, top_tokens=True)
    assert body.endswith(
        b'"top_tokens":[[{"id":5,"text":" Deep","log_prob":-0.25},'
        b'{"id":9,"text":" Wide","log_prob":-2.0}]]}}'
    )


def test_json_best_sequence_by_logprob_is_main_and_n_limits_the_rest():
    steps = out(
        seq([tok(1, " a", -3.0)], FinishReason.LENGTH, index=0, cum=-3.0),
        seq([tok(2, " b", -1.0)], FinishReason.LENGTH, index=1, cum=-1.0),
        seq([tok(3, " c", -2.0)], FinishReason.EOS, index=2, cum=-2.0),
    )
    status, body = complete(steps, details=True, n=2)
    assert status == 200
    assert body == (
        b'{"generated_text":" b","details":{"finish_reason":"length","generated_tokens":1,'
        b'"inputs":"What is","tokens":[{"id":2,"text":" b","log_prob":-1.0}],'
        b'"best_of_sequences":[{"finish_reason":"eos_token","generated_tokens":1,'
        b'"tokens":[{"id":3,"text":" c","log_prob":-2.0}],"generated_text":" c"}]}}'
    )


def test_json_best_of_without_details_is_the_best_text_only():
    steps = out(
        seq([tok(1, " a")], FinishReason.LENGTH, index=0, cum=-3.0),
        seq([tok(2, " b")], FinishReason.LENGTH, index=1, cum=-1.0),
    )
    assert complete(steps, n=2) == (200, b'{"generated_text":" b"}')


def test_json_tgi_compat_is_an_array_with_tgi_token_keys():
    status, body = complete(*TWO_STEPS, details=True, tgi=True)
    assert status == 200
    assert body == (
        b'[{"generated_text":" Deep learning","details":{"finish_reason":"length",'
        b'"generated_tokens":2,"inputs":"What is","tokens":['
        b'{"id":5,"text":" Deep","logprob":-0.25,"special":false},'
        b'{"id":6,"text":" learning","logprob":-0.5,"special":false}]}}]'
    )


def test_json_error_finish_is_seed_error_body_with_424():
    failed = out(seq([DEEP], FinishReason.ERROR, error="CUDA out of memory"))
    assert complete(failed, details=True) == (
        424,
        b'{"generated_text":"","details":{"finish_reason":"error","generated_tokens":null,'
        b'"inputs":null,"tokens":null},"error":"CUDA out of memory","code":424}',
    )


def test_json_one_failed_sequence_fails_the_request():
    steps = out(
        seq([tok(1, " a")], FinishReason.LENGTH, index=0),
        seq([], FinishReason.ERROR, index=1, error="boom"),
    )
    status, body = complete(steps, n=2)
    assert status == 424
    assert orjson.loads(body)["error"] == "boom"


def test_json_abort_is_503():
    status, body = complete(out(seq([], FinishReason.ABORT)))
    assert status == 503
    assert orjson.loads(body)["error"] == "request aborted"


def test_json_unfinished_stream_is_an_error():
    status, body = complete(out(seq([DEEP])))
    assert status == 424
    assert orjson.loads(body)["details"]["finish_reason"] == "error"


# --- streaming ------------------------------------------------------------------------------


def test_jsonlines_one_line_per_token_last_carries_text():
    held = tok(7, "", -0.75)  # text held back (e.g. half a character)
    chunks = stream(
        StreamStyle.JSONLINES,
        out(seq([DEEP, held])),
        out(seq([LEARNING], FinishReason.LENGTH)),
    )
    assert chunks == [
        b'{"token":{"id":5,"text":" Deep","log_prob":-0.25}}\n'
        b'{"token":{"id":7,"text":"","log_prob":-0.75}}\n',
        b'{"token":{"id":6,"text":" learning","log_prob":-0.5},'
        b'"generated_text":" Deep learning"}\n',
    ]


def test_jsonlines_details_on_last_line_only():
    chunks = stream(StreamStyle.JSONLINES, *TWO_STEPS, details=True, return_full_text=True)
    assert chunks[0] == b'{"token":{"id":5,"text":" Deep","log_prob":-0.25}}\n'
    assert chunks[1] == (
        b'{"token":{"id":6,"text":" learning","log_prob":-0.5},'
        b'"generated_text":"What is Deep learning","details":{"finish_reason":"length",'
        b'"generated_tokens":2,"inputs":"What is"}}\n'
    )


def test_jsonlines_several_tokens_in_the_finishing_step():
    chunks = stream(StreamStyle.JSONLINES, out(seq([DEEP, LEARNING], FinishReason.LENGTH)))
    lines = chunks[0].splitlines()
    assert [orjson.loads(line).get("generated_text") for line in lines] == [None, " Deep learning"]


def test_jsonlines_top_tokens_ride_on_each_line():
    top = [TopToken(5, " Deep", -0.25)]
    chunks = stream(
        StreamStyle.JSONLINES,
        out(seq([tok(5, " Deep", -0.25, top=top)], FinishReason.LENGTH)),
        top_tokens=True,
    )
    assert chunks[0] == (
        b'{"token":{"id":5,"text":" Deep","log_prob":-0.25},'
        b'"top_tokens":[{"id":5,"text":" Deep","log_prob":-0.25}],"generated_text":" Deep"}\n'
    )


def test_sse_frames_each_line_as_a_data_event():
    chunks = stream(StreamStyle.SSE, *TWO_STEPS)
    assert chunks == [
        b'data: {"token":{"id":5,"text":" Deep","log_prob":-0.25}}\n\n',
        b'data: {"token":{"id":6,"text":" learning","log_prob":-0.5},'
        b'"generated_text":" Deep learning"}\n\n',
    ]


def test_tgi_stream_has_tgi_keys_and_null_fields_until_the_end():
    chunks = stream(StreamStyle.TGI, *TWO_STEPS, details=True)
    assert chunks == [
        b'data: {"token":{"id":5,"text":" Deep","logprob":-0.25,"special":false},'
        b'"generated_text":null,"details":null}\n\n',
        b'data: {"token":{"id":6,"text":" learning","logprob":-0.5,"special":false},'
        b'"generated_text":" Deep learning","details":{"finish_reason":"length",'
        b'"generated_tokens":2,"inputs":"What is"}}\n\n',
    ]


def test_stream_error_finish_ends_with_the_error_line():
    style = StreamStyle.JSONLINES
    renderer = StreamRenderer(opts(details=True), style)
    first = framed(style, renderer.feed(out(seq([DEEP]))))
    last = framed(style, renderer.feed(out(seq([LEARNING], FinishReason.ERROR, error="boom"))))
    assert first == b'{"token":{"id":5,"text":" Deep","log_prob":-0.25}}\n'
    assert last == b'{"token":{"id":6,"text":" learning","log_prob":-0.5}}\n' + LMI_ERROR_LINE
    assert renderer.done
    assert framed(style, renderer.feed(out(seq([DEEP], FinishReason.LENGTH)))) == b""


def test_stream_error_line_for_an_engine_exception():
    renderer = StreamRenderer(opts(), StreamStyle.SSE)
    renderer.feed(out(seq([DEEP])))
    assert framed(StreamStyle.SSE, renderer.error("engine died")) == (
        b"data: " + LMI_ERROR_LINE + b"\n")


def test_tgi_stream_error_line_names_the_error_for_tgi_clients():
    line = framed(StreamStyle.TGI, StreamRenderer(opts(), StreamStyle.TGI).error("engine died"))
    assert line == (
        b'data: {"token":{"id":-1,"text":"","logprob":-1,"special":true},"generated_text":"",'
        b'"details":{"finish_reason":"error","generated_tokens":null,"inputs":null},'
        b'"error":"engine died"}\n\n'
    )


def test_stream_finish_without_a_token_still_sends_the_final_line():
    chunks = stream(StreamStyle.JSONLINES, out(seq([DEEP])), out(seq([], FinishReason.STOP)))
    assert chunks[1] == (
        b'{"token":{"id":-1,"text":"","log_prob":null,"special_token":true},'
        b'"generated_text":" Deep"}\n'
    )


def test_stream_skips_outputs_without_tokens():
    chunks = stream(StreamStyle.JSONLINES, out(seq([])), *TWO_STEPS)
    assert chunks[0] == b""
    assert chunks[2].endswith(b'"generated_text":" Deep learning"}\n')


# --- choices --------------------------------------------------------------------------------


def test_early_failure_only_before_any_token():
    assert early_failure(out(seq([DEEP]))) is None
    assert early_failure(out(seq([DEEP], FinishReason.ERROR))) is None  # streamed, then error line
    status, body = error_answer(early_failure(out(seq([], FinishReason.ERROR, error="no memory"))))
    assert status == 424
    assert orjson.loads(body)["error"] == "no memory"


@pytest.mark.parametrize(
    ("formatter", "tgi", "stream", "style"),
    [
        # Unset (DJL's default): `stream` decides, SSE in TGI's shape under tgi_compat.
        (None, False, False, None),
        (None, False, True, StreamStyle.JSONLINES),
        (None, True, False, None),
        (None, True, True, StreamStyle.TGI),
        # Set: every request, streamed or not.
        ("jsonlines", False, False, StreamStyle.JSONLINES),
        ("jsonlines", False, True, StreamStyle.JSONLINES),
        ("sse", False, False, StreamStyle.SSE),
        ("sse", True, True, StreamStyle.TGI),
        ("json", False, True, None),
        ("json", True, True, None),
    ],
)
def test_stream_style_follows_djl_output_formatter_rule(formatter, tgi, stream, style):
    assert stream_style(formatter, tgi, stream) is style


def test_several_sequences_cannot_be_streamed():
    request = parse_lmi_request({"inputs": "a", "parameters": {"n": 2}})
    assert answer_style(request, "json", False) is None
    with pytest.raises(LmiError, match="parameters.n"):
        answer_style(request, "jsonlines", False)

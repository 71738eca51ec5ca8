"""The output processor: streamed deltas concatenate to exactly the non-streamed text for any stop
strings (no leaked prefix of a stop string), output kinds, and n > 1 children."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.core.core_output import EngineCoreOutput, SeqDelta
from tessera.engine.output_processor import OutputProcessor, RequestState
from tessera.sampling.params import RequestOutputKind, SamplingParams

TEXT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12"


class CharTokenizer:
    """One token per character: ids are code points."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(map(chr, ids))


def run(text: str, params: SamplingParams, chunk: int = 1) -> tuple[list[str], str, str | None]:
    """Feed `text` `chunk` tokens per step; returns the text of each output, the concatenation
    (or the final text for CUMULATIVE / FINAL_ONLY) and the stop reason."""
    processor = OutputProcessor(CharTokenizer(), clock=lambda: 0.0)
    processor.add_request(RequestState("r", None, [1], params, arrival_time=0.0))
    ids = [ord(c) for c in text]
    pieces: list[str] = []
    final, reason = "", None
    for i in range(0, len(ids), chunk):
        new = ids[i : i + chunk]
        last = i + chunk >= len(ids)
        delta = SeqDelta(0, new, [{}] * len(new), "length" if last else None)
        outputs, stops = processor.process([EngineCoreOutput("r", [delta], finished=last)])
        for out in outputs:
            pieces += [c.text for c in out.outputs]
            final, reason = out.outputs[0].text, out.outputs[0].stop_reason
        if stops or last:
            break
    if params.output_kind is RequestOutputKind.DELTA:
        final = "".join(pieces)
    return pieces, final, reason


@pytest.mark.parametrize("stop", [["6, 7"], [" 7"], ["5, 6, 7, 8"], [",", "9"], ["12"], ["zz"]])
def test_issue_examples_stream_equals_whole(stop):
    whole = run(TEXT, SamplingParams(stop=stop, output_kind=RequestOutputKind.FINAL_ONLY))
    streamed = run(TEXT, SamplingParams(stop=stop, output_kind=RequestOutputKind.DELTA))
    assert streamed[1] == whole[1] and streamed[2] == whole[2]
    cut = min((TEXT.find(s) for s in stop if s in TEXT), default=len(TEXT))
    assert whole[1] == TEXT[:cut]  # e.g. "6, 7" -> "1, 2, 3, 4, 5, "


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab, 12", min_size=1, max_size=40),
    stops=st.lists(st.text(alphabet="ab, 12", min_size=1, max_size=5), min_size=1, max_size=3),
    include=st.booleans(),
    chunk=st.integers(1, 3),
)
def test_streamed_deltas_concatenate_to_the_whole_answer(text, stops, include, chunk):
    def params(kind):
        return SamplingParams(stop=stops, include_stop_str_in_output=include, output_kind=kind)

    pieces, streamed, s_reason = run(text, params(RequestOutputKind.DELTA), chunk)
    _, whole, w_reason = run(text, params(RequestOutputKind.FINAL_ONLY), chunk)
    _, cumulative, c_reason = run(text, params(RequestOutputKind.CUMULATIVE), chunk)
    assert streamed == whole == cumulative
    assert s_reason == w_reason == c_reason
    # nothing after (or, without include, of) the first stop string ever reached the client
    if w_reason is not None:
        assert w_reason in text


def test_cumulative_outputs_are_prefixes_of_the_final_text():
    seen = []
    processor = OutputProcessor(CharTokenizer(), clock=lambda: 0.0)
    params = SamplingParams(stop=["6, 7"])
    processor.add_request(RequestState("r", None, [1], params, arrival_time=0.0))
    for c in TEXT:
        outs, stops = processor.process([EngineCoreOutput("r", [SeqDelta(0, [ord(c)], [{}])])])
        seen += [o.outputs[0].text for o in outs]
        if stops:
            assert stops == [("r", 0, "6, 7")]
            break
    final = seen[-1]
    assert final == "1, 2, 3, 4, 5, " and all(final.startswith(s) for s in seen)
    assert "6" not in "".join(seen)  # the held-back start of the stop string never showed


def test_final_only_emits_once_and_delta_skips_empty_steps():
    processor = OutputProcessor(CharTokenizer(), clock=lambda: 0.0)
    processor.add_request(RequestState(
        "f", None, [1], SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY), 0.0))
    processor.add_request(RequestState(
        "d", None, [1], SamplingParams(n=2, output_kind=RequestOutputKind.DELTA), 0.0))
    outs, _ = processor.process([
        EngineCoreOutput("f", [SeqDelta(0, [97], [{97: -1.0}])]),
        EngineCoreOutput("d", [SeqDelta(0, [98], [{98: -0.5}]), SeqDelta(1, [99], [{99: -0.25}])]),
    ])
    assert [o.request_id for o in outs] == ["d"]
    assert [(c.index, c.text, c.token_ids) for c in outs[0].outputs] == [
        (0, "b", [98]),
        (1, "c", [99]),
    ]
    # only child 1 moves: child 0 is left out of the delta
    outs, _ = processor.process([EngineCoreOutput("d", [SeqDelta(1, [100], [{}])])])
    assert [(c.index, c.text) for c in outs[0].outputs] == [(1, "d")]
    outs, _ = processor.process([
        EngineCoreOutput("f", [SeqDelta(0, [98], [{98: -2.0}], "length")], finished=True)])
    [out] = outs
    assert out.finished and out.outputs[0].text == "ab" and out.outputs[0].token_ids == [97, 98]
    assert out.outputs[0].cumulative_logprob == pytest.approx(-3.0)
    assert "f" not in processor.requests

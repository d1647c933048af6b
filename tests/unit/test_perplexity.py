"""The sliding-window arithmetic and NLL of shardwise.engine.perplexity, on one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.engine.perplexity import Window, check_windows, perplexity, window_nll, windows
from shardwise.models.config import ModelConfig
from shardwise.models.decoder import DecoderLM


def test_docstring_example_and_disjoint_windows():
    assert windows(14, 8, 4) == [Window(0, 8, 1), Window(4, 12, 8), Window(8, 14, 12)]
    assert windows(14, 8) == [Window(0, 8, 1), Window(8, 14, 9)]  # stride = context: disjoint
    assert windows(8, 8) == [Window(0, 8, 1)]  # one window exactly
    assert windows(2, 256) == [Window(0, 2, 1)]


@pytest.mark.parametrize("n", [2, 3, 7, 8, 9, 50, 257])
@pytest.mark.parametrize(("context", "stride"), [(2, 1), (2, 2), (8, 1), (8, 3), (8, 7), (8, 8), (16, 5)])
def test_every_token_scored_once_with_the_window_context(n, context, stride):
    spans = windows(n, context, stride)
    scored = [t for w in spans for t in range(w.first, w.end)]
    if stride < context:  # overlapping: every token but the first
        assert scored == list(range(1, n))
    else:  # disjoint: all but each window's first token
        assert scored == [t for t in range(1, n) if t % context != 0]
    assert spans[-1].end == n and all(w.end - w.begin <= context for w in spans)
    assert [w.begin for w in spans] == list(range(0, stride * len(spans), stride))
    for w in spans[1:]:  # a later window's first scored token reads context - stride tokens (disjoint: 1)
        assert w.first - w.begin == (context - stride if stride < context else 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((1, 8, 8), "the text is 1 token(s) long; perplexity needs at least 2"),
        ((100, 8, 9), "stride must be between 1 and the context (8), got 9"),
        ((100, 8, 0), "stride must be between 1 and the context (8), got 0"),
        ((100, 1, 1), "context must be >= 2 tokens (one to read, one to score), got 1"),
        ((100, 600, 600, 512), "context 600 is more than the model's 512 positions"),
    ],
)
def test_bad_windows_name_the_numbers(args, message):
    with pytest.raises(ValueError) as e:
        check_windows(*args)
    assert str(e.value) == message


def test_window_nll_is_cross_entropy_of_the_scored_tokens():
    torch.manual_seed(0)
    w = Window(begin=10, end=16, first=13)  # reads 6 tokens, scores the last 3
    logits, ids = torch.randn(8, 20), torch.randint(0, 20, (8,))  # 2 positions of right padding
    expected = F.cross_entropy(logits[2:5], ids[3:6], reduction="none").double()
    torch.testing.assert_close(window_nll(logits, ids, w), expected)
    # uniform logits: NLL log V per token, perplexity V
    assert window_nll(torch.zeros(6, 20), ids[:6], w).tolist() == pytest.approx([math.log(20)] * 3)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = ModelConfig.debug(max_positions=64)
    return DecoderLM(cfg).eval(), torch.randint(0, cfg.vocab_size, (101,))


@pytest.mark.parametrize(("context", "stride"), [(16, 16), (16, 5), (32, 31)])
def test_perplexity_equals_window_by_window_cross_entropy(tiny, context, stride):
    """Any batch size (right-padded last chunk included) gives the unbatched windows' mean NLL."""
    model, ids = tiny
    nlls = []
    with torch.no_grad():
        for w in windows(len(ids), context, stride):
            logits = model(ids[None, w.begin : w.end])[0]  # (T, V)
            nlls.append(F.cross_entropy(logits[w.first - w.begin - 1 : -1], ids[w.first : w.end], reduction="none"))
    ref = torch.cat(nlls).double()
    for batch in (1, 3, 64):
        res = perplexity(model, ids.tolist(), context=context, stride=stride, batch=batch)
        assert res.tokens == len(ref) and res.windows == len(windows(len(ids), context, stride))
        assert res.mean_nll == pytest.approx(ref.mean().item(), rel=1e-6)
        assert res.ppl == pytest.approx(math.exp(ref.mean().item()), rel=1e-6)


def test_perplexity_refuses_a_batch_of_zero(tiny):
    with pytest.raises(ValueError, match="batch must be >= 1 window, got 0"):
        perplexity(tiny[0], tiny[1], context=16, batch=0)

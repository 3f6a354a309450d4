"""Greedy MTP decoding is token-identical to greedy decoding without MTP and to mlx-lm's generate."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from helpers import PROMPTS
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step

from mtpipe.coordinator.engine.build import local_engine
from mtpipe.coordinator.engine.request import GenerationRequest, resolve_depth
from mtpipe.models.loading import load_shard

MAX_TOKENS = 64


def mlx_lm_tokens(model, tokenizer, prompt: list[int], eos: set[int]) -> list[int]:
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS):
        tok = int(tok)
        if tok in eos:
            break
        out.append(tok)
    return out


def test_backbone_logits_match_mlx_lm(ckpt: Path) -> None:
    """Stepped (as decode and verify run the GatedDeltaNet recurrence) within 2e-5: bit for bit on the
    reference BLAS, up to 1.2e-5 measured on an optimized one, which sums the recurrence's reads of the
    state (matrix products here, mlx-lm's sums) in its own order. As a prefill runs it on the CPU,
    chunked (the same sums in another order: gdn_chunked.py), within 1e-4 (up to 3e-5 measured on these
    random weights, of logits up to about 2)."""
    model, tok = mlx_load(str(ckpt))
    ours = load_shard(ckpt).model
    x = mx.array([tok.encode(PROMPTS[2] + PROMPTS[3])])
    ref = model(x)
    for capture, tol in ((True, 2e-5), (False, 1e-4)):
        h, _ = ours.run_layers(ours.embed(x), ours.make_cache(), capture=capture)
        assert mx.abs(ours.lm_logits(ours.final_norm(h)) - ref).max().item() <= tol, capture


def check_identity_all_depths(ckpt: Path, prompts: list[str], every_depth: bool = True) -> None:
    """Each prompt at depth 0, auto and every fixed depth; or, without `every_depth` (the default
    suite's time), at depth 0, auto and one fixed depth, taken in turn so each is run."""
    engine = local_engine(ckpt, dtype=mx.float32)
    model, tok = mlx_load(str(ckpt))
    for i, text in enumerate(prompts):
        prompt = tok.encode(text)
        reference = mlx_lm_tokens(model, tok, prompt, engine.eos)
        for depth in (0, 1, 2, 3, "auto") if every_depth else (0, 1 + i % 3, "auto"):
            drafts, auto = resolve_depth(depth, engine.has_mtp)
            req = GenerationRequest(prompt, max_tokens=MAX_TOKENS, mtp_depth=drafts, mtp_auto=auto)
            result = engine.complete(req)
            assert result.tokens == reference, f"depth {depth} diverged on {text!r}"
            if depth and not auto:
                assert result.stats.drafted > 0 and set(result.stats.depths) == {depth}
            if auto:
                assert set(result.stats.depths) <= {0, 1, 2, 3} and sum(result.stats.depths.values()) == result.stats.rounds


def test_greedy_identity_all_depths(dense_ckpt: Path) -> None:
    """Every fifth prompt, each fixed depth on a third of them, by default (the suite's time budget);
    every prompt at every depth with -m slow."""
    check_identity_all_depths(dense_ckpt, PROMPTS[::5], every_depth=False)


@pytest.mark.slow
def test_greedy_identity_all_depths_every_prompt(dense_ckpt: Path) -> None:
    assert len(PROMPTS) >= 20
    check_identity_all_depths(dense_ckpt, PROMPTS)


def test_greedy_identity_all_depths_moe(moe_ckpt: Path) -> None:
    """Every eighth prompt, fixed depths in turn (1, 2, 3), by default (the MoE path is the same code past
    the MLP); every prompt at every depth with -m slow."""
    check_identity_all_depths(moe_ckpt, PROMPTS[::8], every_depth=False)


@pytest.mark.slow
def test_greedy_identity_all_depths_moe_every_prompt(moe_ckpt: Path) -> None:
    check_identity_all_depths(moe_ckpt, PROMPTS)


@pytest.fixture(scope="module")
def single_stage_tokens(dense_ckpt: Path) -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens of each prompt on one stage (without drafts: the same at every depth), for the
    split pipelines to match."""
    single = local_engine(dense_ckpt, dtype=mx.float32)
    return {tuple(p): single.complete(GenerationRequest(p, max_tokens=32)).tokens
            for p in (single.tokenizer.encode(text) for text in PROMPTS[:4])}


@pytest.mark.parametrize("stages", [2, 3])
def test_in_process_stages_identical(dense_ckpt: Path, stages: int, single_stage_tokens: dict) -> None:
    split = local_engine(dense_ckpt, stages=stages, dtype=mx.float32)
    for prompt, want in single_stage_tokens.items():
        for depth, auto in ((0, False), (2, False), (3, True)):
            req = GenerationRequest(list(prompt), max_tokens=32, mtp_depth=depth, mtp_auto=auto)
            assert split.complete(req).tokens == want, (depth, auto)


def test_pre_norm_mtp_option(dense_ckpt: Path) -> None:
    """Pre-norm hidden feeds the MTP head other inputs (other drafts), and greedy output stays exact."""
    post = local_engine(dense_ckpt, dtype=mx.float32)
    pre = local_engine(dense_ckpt, dtype=mx.float32, mtp_pre_norm=True)
    prompt = post.tokenizer.encode(PROMPTS[0])
    req = GenerationRequest(prompt, max_tokens=24, mtp_depth=2)
    a, b = post.complete(req), pre.complete(req)
    assert a.tokens == b.tokens == post.complete(GenerationRequest(prompt, max_tokens=24)).tokens
    from mtpipe.node.protocol import StepKind, StepRequest

    # The drafts differ: compare the first ones after prefilling each prompt.
    differ = 0
    for j, text in enumerate(PROMPTS[:4]):
        ids = post.tokenizer.encode(text)
        outs = [e.pipeline.step(StepRequest(f"x{i}-{j}", 0, StepKind.PREFILL, ids, final=True, mtp_depth=3))
                for i, e in enumerate((post, pre))]
        assert outs[0].tokens == outs[1].tokens
        differ += outs[0].drafts != outs[1].drafts
    assert differ

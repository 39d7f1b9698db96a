"""PCP over the GPU backends' code on the CPU: the Triton kernels under the interpreter and KDA chunks by
the reference chunk form (``TANDEM_BACKEND=interpret``) in real rank processes. What the H200 runs under
PCP — strided query positions in one attention launch (MLA absorbed and expanded, GQA), the KDA mixer in
the segment layout with the scan through a chunk kernel's widened pass — gives the single-rank reference
engine's tokens and prompt logits."""

from __future__ import annotations

import pytest
import torch

from engine.parallel.config import ParallelConfig
from tests.conftest import random_prompts
from tests.kernels.helpers import ON_CUDA
from tests.parallel import helpers

KW = dict(max_num_seqs=4, max_num_batched_tokens=512)
# prefill only: a decode step runs fla's fused recurrent kernel, which needs a GPU (the row layout it runs in
# under PCP is the CPU path's, tested in tests/parallel)
GREEDY = helpers.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


@pytest.mark.skipif(ON_CUDA, reason="the interpreter stands in for a GPU; on a GPU the compiled path runs instead")
@pytest.mark.parametrize("arch", ["kimi_linear", "qwen3"])
def test_pcp_over_the_gpu_backends_matches_one_rank(arch, tiny_models, monkeypatch):
    """400 tokens: 200 query rows a rank, the expanded MLA form (>= 192 rows); 37 and 130 alongside: the
    absorbed form, odd lengths (padding rows), a sequence shorter than a KDA chunk (one segment). 567 tokens
    over a 512-token budget: the second step continues a prompt from its cached state."""
    prompts = random_prompts(3, [400, 37, 130], seed=61)
    want = helpers.reference(tiny_models[arch], tuple(tuple(p) for p in prompts), GREEDY, **KW)
    ref_logits = helpers.engine(tiny_models[arch], **KW).prompt_logits(prompts[0])
    monkeypatch.setenv("TANDEM_BACKEND", "interpret")
    eng = helpers.engine(tiny_models[arch], ParallelConfig(pcp=2), **KW)
    try:
        assert helpers.tokens(eng.generate(prompts, GREEDY)) == want
        torch.testing.assert_close(eng.prompt_logits(prompts[0]), ref_logits, rtol=0, atol=1e-4)
    finally:
        eng.close()

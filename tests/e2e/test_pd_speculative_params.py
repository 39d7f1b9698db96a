"""Speculative parameters reach only the decode worker; a prefill worker refuses them."""

from __future__ import annotations

import asyncio

import grpc
import openai
import pytest

from tandem.cluster import LocalCluster
from tandem.rpc import prefill_pb2, prefill_pb2_grpc
from tests.conftest import random_prompts


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    c = LocalCluster(tiny_models["qwen3"], log_dir=tmp_path_factory.mktemp("spec-logs"))
    c.start()
    yield c
    c.stop()


def test_prefill_worker_refuses_speculative_request(cluster):
    req = prefill_pb2.PrefillRequest(request_id="spec", prompt_token_ids=[5, 6, 7])
    req.params.max_tokens = 1
    req.speculative.num_speculative_tokens = 3

    async def run():
        async with grpc.aio.insecure_channel(cluster.worker("prefill").endpoint) as ch:
            async for _ in prefill_pb2_grpc.PrefillStub(ch).Prefill(req):
                pass

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(run())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "never speculate" in err.value.details()


def test_request_with_speculative_params_is_served_through_decode(cluster):
    client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
    prompt = random_prompts(1, [12], seed=31)[0]
    plain = client.completions.create(model="qwen3", prompt=prompt, max_tokens=8, temperature=0)
    spec = client.completions.create(
        model="qwen3", prompt=prompt, max_tokens=8, temperature=0, extra_body={"num_speculative_tokens": 3}
    )
    assert spec.choices[0].text == plain.choices[0].text

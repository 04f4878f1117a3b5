"""MTP speculative decoding through the P/D path stays lossless and keeps its acceptance.

Engines (real vLLM, separate processes, float32): aggregated without MTP, aggregated with MTP
k, and a prefill + decode pair with MTP k. Greedy output must be identical everywhere, tokens and
logprobs (tests/support/identity.py); the P/D acceptance rate must be within 3 points of the
aggregated one on the same prompts (a lower P/D rate means the draft layer's KV was not handed
over right). k = 2: the prefill stops k - 1 tokens short of the prompt's end and decode
recomputes them (at k = 1 there is nothing to back off); P/D at the shipped k = 1 is checked
token for token against the same reference by test_cluster (float32) and test_bf16_identity.
"""

from __future__ import annotations

import pytest

from tests.support.cores import FIRST, SECOND
from tests.support.engines import run_engines, tiny_engine
from tests.support.handoff import complete
from tests.support.identity import Greedy, assert_same_greedy
from tests.support.prompts import heldout_prompts

pytestmark = pytest.mark.e2e

DTYPE = "float32"
KS = (2,)
PROMPTS = heldout_prompts()[:24]
MAX_TOKENS = 48


def spec(engine_id, role, k, bind, secret_file):
    return tiny_engine(
        engine_id,
        role,
        dtype=DTYPE,
        secret_file=secret_file,
        engine_args={"max_num_seqs": 8},
        speculative={"method": "mtp", "num_speculative_tokens": k} if k else None,
        cpu_threads_bind=bind,
    )


@pytest.fixture(scope="module")
def engines(tmp_path_factory, reference_engine):
    tmp = tmp_path_factory.mktemp("mtp")
    secret = tmp / "secret"
    secret.write_text("mtp-test-secret")
    specs = []
    for k in KS:
        specs += [
            spec(f"agg-k{k}", "aggregated", k, SECOND, secret),
            spec(f"prefill-k{k}", "prefill", k, FIRST, secret),
            spec(f"decode-k{k}", "decode", k, SECOND, secret),
        ]
    with run_engines(specs, tmp) as running:
        yield {"agg-off": reference_engine, **running}  # the reference: no speculation (conftest.py)


def generate(engine, prompt, kv_transfer_params=None, max_tokens=MAX_TOKENS, **sampling):
    extra = {} if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    response = complete(engine, prompt, max_tokens, **extra, **sampling)
    assert response.status_code == 200, response.text
    return response.json()


def spec_counters(engine):
    with engine.client() as client:
        stats = client.get("/pdcluster/info").json()["stats"]
    return stats["spec_draft_tokens"], stats["spec_accepted_tokens"]


def acceptance(engine, run):
    drafts0, accepted0 = spec_counters(engine)
    outputs = run()
    drafts1, accepted1 = spec_counters(engine)
    assert drafts1 > drafts0, "no draft tokens: speculative decoding did not run"
    return outputs, (accepted1 - accepted0) / (drafts1 - drafts0)


@pytest.fixture(scope="module")
def reference(engines):
    return [Greedy.from_choice(generate(engines["agg-off"], p)["choices"][0]) for p in PROMPTS]


@pytest.mark.parametrize("k", KS)
def test_pd_with_mtp_is_lossless_and_keeps_acceptance(engines, reference, k):
    agg, prefill, decode = engines[f"agg-k{k}"], engines[f"prefill-k{k}"], engines[f"decode-k{k}"]

    agg_out, agg_rate = acceptance(agg, lambda: [Greedy.from_choice(generate(agg, p)["choices"][0]) for p in PROMPTS])

    def pd_run():
        outputs = []
        for prompt in PROMPTS:
            params = generate(prefill, prompt, {"do_remote_decode": True}, max_tokens=1)["kv_transfer_params"]
            outputs.append(Greedy.from_choice(generate(decode, prompt, params)["choices"][0]))
        return outputs

    pd_out, pd_rate = acceptance(decode, pd_run)
    for i, want in enumerate(reference):
        assert_same_greedy(want, agg_out[i], DTYPE, f"aggregated MTP k={k}, prompt {i}")  # == no MTP
        assert_same_greedy(want, pd_out[i], DTYPE, f"P/D MTP k={k}, prompt {i}")  # == no MTP
    assert abs(pd_rate - agg_rate) <= 0.03, f"P/D acceptance {pd_rate:.3f} vs aggregated {agg_rate:.3f}"
    assert agg_rate > 0.3  # the trained head drafts well; a broken handoff would not move this


NEAR_ZERO_TEMPERATURE = 1e-4  # sampled (the rejection sampler's random path), yet all but greedy
NEAR_TIE = 0.01  # a top-1 margin under which even that temperature may pick the runner-up


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("constraints", [{"top_k": 5}, {"top_p": 0.9}, {}], ids=["top_k", "top_p", "temperature"])
def test_sampled_requests_with_mtp_are_judged_at_their_own_sampling_parameters(engines, reference, k, constraints):
    """A sampled request at a temperature near zero yields the greedy tokens, aggregated and
    through P/D, up to its first near tie: its draft tokens are judged at its own temperature,
    top_k and top_p. On CPU, vLLM spread those over the drafts as uninitialized memory (tokens off
    the greedy ones, or an index error that killed the engine core), and a top_k-only request
    killed it in a step without drafts (compat.fix_cpu_spec_sampling)."""
    agg, prefill, decode = engines[f"agg-k{k}"], engines[f"prefill-k{k}"], engines[f"decode-k{k}"]
    sampling = {"temperature": NEAR_ZERO_TEMPERATURE, "seed": 7, **constraints}
    compared = 0
    for i, prompt in enumerate(PROMPTS[:4]):
        want = reference[i]
        until = next((j for j, gap in enumerate(want.gaps) if gap < NEAR_TIE), len(want.token_ids))
        params = generate(prefill, prompt, {"do_remote_decode": True}, max_tokens=1, **sampling)["kv_transfer_params"]
        runs = {
            "aggregated": generate(agg, prompt, **sampling),
            "P/D": generate(decode, prompt, params, **sampling),
        }
        for setup, answer in runs.items():
            got = [int(t) for t in answer["choices"][0]["token_ids"]]
            assert got[:until] == want.token_ids[:until], f"{setup} MTP k={k} {constraints}, prompt {i}"
        compared += until
    assert compared >= 40, "too few tokens before a near tie to tell"

"""The OpenAI-compatible server on tiny models, over real loopback sockets.

Three servers start once for the module: a draft-model speculating one (no auth), a plain
decoding one behind an API key, and one whose drafter can be slowed, blocked or made to fail.
"""

import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from tiny_models import anti_copy, noisy_copy, tiny_target, write_tiny_qwen2_gguf
from verispec import DraftModel, SamplingParams, SpeculativeDecoder
from verispec.drafters import Proposal, lookup_then_model
from verispec.models import LoadedModel, encode_chat, encode_prompt
from verispec.serving import BatchGammaPolicy, GenerationRequest, Scheduler, SchedulerConfig, ServeConfig, create_app

MODEL = "tiny"
KEY = "sekrit-key"
WORDS = ["def", "add", "the", "hello", "world", "return", "for", "x", "in", "range", "print", "if"]
PROMPTS = [" ".join(WORDS[(i * 7 + j * (i % 5 + 1)) % len(WORDS)] for j in range(2 + i % 9)) for i in range(32)]


class Server:
    """uvicorn serving ``app`` in a background thread on a free loopback port."""

    def __init__(self, app) -> None:
        self.app = app
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    # The tiny GGUF's real byte-level BPE tokenizer and chat template, with a sharper tiny target.
    path = tmp_path_factory.mktemp("tokenizer") / "tiny.gguf"
    write_tiny_qwen2_gguf(path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def target(tokenizer):
    return LoadedModel(model=tiny_target(vocab_size=len(tokenizer)), tokenizer=tokenizer, name=MODEL, path=None)


def _serve(target, drafter, **config):
    scheduler = SchedulerConfig(**config.pop("scheduler", {}))
    return Server(create_app(ServeConfig(model_id=MODEL, scheduler=scheduler, **config), target, drafter))


@pytest.fixture(scope="module")
def draft_server(target):
    # Speculation stays on (tapering) up to the 32 concurrent requests of the batching test.
    drafter = DraftModel(noisy_copy(target.model, noise=0.2))
    server = _serve(target, drafter, scheduler={"gamma": 4, "gamma_policy": BatchGammaPolicy(full_until=4, off_from=40)})
    yield server
    server.close()


@pytest.fixture(scope="module")
def lookup_server(target):
    # The generate/compare default drafter: lookup on a 2+ token match, the draft model otherwise.
    drafter = lookup_then_model(DraftModel(noisy_copy(target.model, noise=0.2)))
    server = _serve(target, drafter, scheduler={"gamma": 4, "gamma_policy": BatchGammaPolicy(full_until=4, off_from=40)})
    yield server
    server.close()


@pytest.fixture(scope="module")
def auto_server(target):
    # --drafter auto: lookup + draft model for prompts below 6 tokens, lookup + an EAGLE head from 6:
    # sessions of both kinds share the batch.
    from verispec.drafters.by_length import LengthSwitchDrafter
    from verispec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead

    torch.manual_seed(3)
    head = EagleHead(EagleConfig.for_target(target.model.config, 24)).eval().requires_grad_(False)
    short = lookup_then_model(DraftModel(noisy_copy(target.model, noise=0.2)))
    drafter = LengthSwitchDrafter(short, lookup_then_model(EagleDrafter(target.model, head)), 6)
    server = _serve(target, drafter, scheduler={"gamma": 4, "gamma_policy": BatchGammaPolicy(full_until=4, off_from=40)})
    yield server
    server.close()


@pytest.fixture(scope="module")
def plain_server(target):
    server = _serve(target, None, api_key=KEY)
    yield server
    server.close()


class ScriptedDrafter:
    """Drafts nothing, but can be slowed, blocked (``gate``) or made to raise for one prompt token."""

    name = "scripted"
    needs_target_features = False

    def __init__(self, poison: int) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.delay = 0.0
        self.poison = poison

    def start(self, prompt_ids, sampling):
        return self

    def propose(self, context, max_tokens, generator):
        self.gate.wait(30)
        time.sleep(self.delay)
        if self.poison in context.token_ids:
            raise RuntimeError("the scripted drafter was told to fail")
        return Proposal(tokens=[], probs=None)

    def close(self):
        pass


@pytest.fixture(scope="module")
def scripted(target, tokenizer):
    drafter = ScriptedDrafter(poison=encode_prompt(tokenizer, "@", chat=False)[0])
    # Drafting (so the scripted drafter runs) at every batch size.
    server = _serve(target, drafter, scheduler={"max_batch": 2, "max_queue": 2, "gamma_policy": BatchGammaPolicy(full_until=4, off_from=40)})
    yield server, drafter
    server.close()


def _stream_lines(url, body, headers=None):
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line]


def _metrics(server, headers=None):
    text = httpx.get(f"{server.url}/metrics", headers=headers).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def _total(values, name):
    return sum(v for (n, _), v in values.items() if n == name)


def _error(response, status, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


# --- The OpenAI client: completions, chat, streaming -------------------------------------------


def test_completion_and_chat_return_text_and_usage(draft_server, tokenizer):
    client = draft_server.client()
    completion = client.completions.create(model=MODEL, prompt="def add the", max_tokens=12, temperature=0)
    assert completion.choices[0].text and completion.choices[0].finish_reason == "length"
    assert completion.usage.prompt_tokens == len(encode_prompt(tokenizer, "def add the", chat=False))
    assert completion.usage.completion_tokens == 12 and completion.usage.total_tokens == completion.usage.prompt_tokens + 12
    extension = completion.model_extra["verispec"]
    assert 0 <= extension["acceptance_rate"] <= 1 and 1 <= extension["tokens_per_call"] <= 5 and extension["target_calls"] >= 3

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello world"}], max_tokens=10, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    messages = [{"role": "user", "content": "hello world"}]
    assert chat.usage.prompt_tokens == len(encode_chat(tokenizer, messages, add_generation_prompt=True))
    assert chat.usage.completion_tokens == 10
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_chunks_concatenate_to_the_non_streamed_text(draft_server, chat):
    client = draft_server.client()
    if chat:
        create, request = client.chat.completions.create, {"messages": [{"role": "user", "content": "for x in range"}]}
    else:
        create, request = client.completions.create, {"prompt": "for x in range"}
    settings = {"model": MODEL, "max_tokens": 20, "temperature": 0, **request}
    whole = create(**settings)
    chunks = list(create(**settings, stream=True, stream_options={"include_usage": True}))
    pieces = [(c.choices[0].delta.content if chat else c.choices[0].text) or "" for c in chunks if c.choices]
    expected = whole.choices[0].message.content if chat else whole.choices[0].text
    assert "".join(pieces) == expected
    assert len([p for p in pieces if p]) > 1  # really streamed, not one blob
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 20
    path = "/v1/chat/completions" if chat else "/v1/completions"
    lines = _stream_lines(draft_server.url + path, {**settings, "stream": True})
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


# --- Continuous batching: no cross-talk, nothing lost --------------------------------------------


def _stream_completion(server, prompt, max_tokens, api_key="unused", **sampling):
    client = server.client(api_key)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}, **sampling)
    chunks = list(stream)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage, chunks[-1].model_extra["verispec"]


@pytest.mark.parametrize("which", ["draft_server", "lookup_server", "auto_server", "plain_server"])
def test_32_concurrent_streams_each_get_exactly_their_text_alone(which, request, target, tokenizer):
    server = request.getfixturevalue(which)
    if which == "auto_server":  # both drafters get requests
        lengths = [len(encode_prompt(tokenizer, prompt, chat=False)) for prompt in PROMPTS]
        assert min(lengths) < 6 <= max(lengths)
    key = KEY if which == "plain_server" else "unused"
    headers = {"Authorization": f"Bearer {KEY}"}
    max_tokens = 16
    before = _metrics(server, headers)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _stream_completion(server, p, max_tokens, key, temperature=0), PROMPTS))
    after = _metrics(server, headers)
    engine = SpeculativeDecoder(target)
    for prompt, (text, usage, _) in zip(PROMPTS, together):
        expected = engine.generate(encode_prompt(tokenizer, prompt, chat=False), max_tokens)
        assert text == expected.text and usage.completion_tokens == max_tokens
    for prompt in PROMPTS[:4]:  # the same request alone
        assert _stream_completion(server, prompt, max_tokens, key, temperature=0)[0] == next(t for p, (t, _, _) in zip(PROMPTS, together) if p == prompt)
    # Batched for real: far fewer target passes than the requests' own verification rounds added up.
    own_rounds = sum(extension["target_calls"] for _, _, extension in together)
    shared = after[("verispec_target_calls_total", ())] - before[("verispec_target_calls_total", ())]
    assert shared < own_rounds / 4


def test_seeded_sampling_repeats_alone_and_under_traffic(draft_server):
    sampled = {"temperature": 0.8, "seed": 7}
    first = _stream_completion(draft_server, "print hello world", 24, **sampled)[0]
    assert _stream_completion(draft_server, "print hello world", 24, **sampled)[0] == first
    with ThreadPoolExecutor(9) as pool:
        others = [pool.submit(_stream_completion, draft_server, p, 24, temperature=0) for p in PROMPTS[:8]]
        busy = pool.submit(_stream_completion, draft_server, "print hello world", 24, **sampled)
        assert busy.result()[0] == first
        assert all(o.result()[0] for o in others)
    other_seed = _stream_completion(draft_server, "print hello world", 24, temperature=0.8, seed=8)[0]
    assert other_seed != first  # the seed matters (these tiny models are far from deterministic at T=0.8)


# --- Cancellation, failure isolation, back-pressure ----------------------------------------------


def _wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _hang_up_and_check_the_row_is_freed(scripted, hang_up):
    """``hang_up(server)`` starts a 300-token request and goes away; the server must stop generating."""
    server, drafter = scripted
    drafter.delay = 0.02  # ~20 ms a round: 300 tokens would take 6 s
    try:
        before = _metrics(server)
        hang_up(server)
        _wait_for(lambda: _metrics(server)[("verispec_running_batch_size", ())] == 0)
        after = _metrics(server)
        assert _total(after, "verispec_generated_tokens_total") - _total(before, "verispec_generated_tokens_total") < 250
        assert httpx.get(f"{server.url}/health").json()["running"] == 0
    finally:
        drafter.delay = 0.0
    later = server.client().completions.create(model=MODEL, prompt="the world", max_tokens=5, temperature=0)
    assert later.usage.completion_tokens == 5


def test_a_client_disconnecting_mid_stream_frees_its_row(scripted):
    def hang_up(server):
        body = {"model": MODEL, "prompt": "the world", "max_tokens": 300, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line).startswith("data: ")

    _hang_up_and_check_the_row_is_freed(scripted, hang_up)


def test_a_client_disconnecting_from_a_non_streamed_request_frees_its_row(scripted):
    def hang_up(server):
        body = {"model": MODEL, "prompt": "the world", "max_tokens": 300, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after 0.5 s and closes the socket
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)

    _hang_up_and_check_the_row_is_freed(scripted, hang_up)


def test_a_failing_request_fails_alone(scripted):
    server, _ = scripted
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(httpx.post, f"{server.url}/v1/completions", json={**body, "prompt": "hello @ world"}, timeout=30)
        good = pool.submit(httpx.post, f"{server.url}/v1/completions", json={**body, "prompt": "hello world"}, timeout=30)
        error = _error(bad.result(), 500)
        assert error["type"] == "server_error" and "told to fail" in error["message"]
        assert good.result().status_code == 200 and good.result().json()["usage"]["completion_tokens"] == 8


def test_a_full_queue_answers_429(scripted):
    server, drafter = scripted
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0}
    drafter.gate.clear()  # the scheduler blocks inside the first request's round
    with ThreadPoolExecutor(3) as pool:
        try:
            running = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=30)
            _wait_for(lambda: httpx.get(f"{server.url}/health").json()["running"] == 1)
            waiting = [pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=30) for _ in range(2)]
            _wait_for(lambda: httpx.get(f"{server.url}/health").json()["waiting"] == 2)  # max_queue
            error = _error(httpx.post(f"{server.url}/v1/completions", json=body, timeout=30), 429)
            assert error["code"] == "rate_limit_exceeded"
        finally:
            drafter.gate.set()
        assert [r.result().status_code for r in (running, *waiting)] == [200] * 3


# --- Auth and bad input ---------------------------------------------------------------------------


def test_api_key_is_required_everywhere_but_health(plain_server):
    url = plain_server.url
    for path in ("/v1/models", "/metrics"):
        _error(httpx.get(url + path), 401)
        _error(httpx.get(url + path, headers={"Authorization": "Bearer wrong"}), 401)
        assert httpx.get(url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    _error(httpx.post(url + "/v1/completions", json=body), 401)
    assert httpx.get(url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        plain_server.client("wrong").completions.create(**body)
    assert plain_server.client(KEY).completions.create(**body).usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"n": 2}, 400, "n"),
        ({"temperature": -1}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"top_p": 1.5}, 400, "top_p"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": "5"}, 400, "max_tokens"),
        ({"top_k": -3}, 400, "top_k"),
        ({"stream": "yes"}, 400, "stream"),
        ({"stop": ["a", ""]}, 400, "stop"),
        ({"max_tokens": 100_000}, 400, "max_tokens"),
        ({"prompt": "   "}, 400, "prompt"),
        ({"prompt": [5, 99_999]}, 400, "prompt"),
        ({"prompt": None}, 400, "prompt"),
        ({"model": "gpt-4"}, 404, "model"),
    ],
)
def test_bad_parameters_get_openai_errors(draft_server, change, status, param):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **change}
    _error(httpx.post(f"{draft_server.url}/v1/completions", json=body), status, param)


def test_malformed_requests_get_openai_errors(draft_server):
    url = draft_server.url
    _error(httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}), 400)
    _error(httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL}), 400, "messages")
    _error(httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}), 400)
    _error(httpx.post(f"{url}/v1/chat/completions", json=[1, 2]), 400)
    error = _error(httpx.post(f"{url}/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "hi"}]}), 404)
    assert error["code"] == "model_not_found"
    long_prompt = " ".join(["hello"] * 600)  # beyond the tiny model's 512 positions
    assert _error(httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": long_prompt}), 400)["code"] == "context_length_exceeded"
    _error(httpx.get(f"{url}/v1/nothing-here"), 404)


# --- Metrics --------------------------------------------------------------------------------------


def test_metrics_parse_and_add_up(draft_server):
    before = _metrics(draft_server)
    client = draft_server.client()
    usages = [client.completions.create(model=MODEL, prompt=p, max_tokens=9, temperature=0).usage for p in PROMPTS[:3]]
    usages.append(_stream_completion(draft_server, PROMPTS[3], 7, temperature=0)[1])
    after = _metrics(draft_server)

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("verispec_generated_tokens_total") == sum(u.completion_tokens for u in usages) == 34
    assert delta("verispec_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("verispec_requests_total", (("endpoint", "/v1/completions"), ("status", "200"))) == 4
    assert delta("verispec_time_to_first_token_seconds_count") == 4
    assert delta("verispec_time_per_output_token_seconds_count") == 34 - 4
    accepted, drafted = _total(after, "verispec_accepted_tokens_total"), _total(after, "verispec_draft_tokens_total")
    assert 0 < accepted <= drafted
    assert _total(after, "verispec_accepted_tokens_by_position_total") == accepted
    assert after[("verispec_running_batch_size", ())] == 0 and after[("verispec_queue_length", ())] == 0
    assert after[("verispec_gamma", ())] == 4 and 0 <= after[("verispec_round_drafts", ())] <= 4  # one request in the last round


# --- Target features for feature-level drafters (EAGLE) ------------------------------------------


class FeatureRecorder:
    """Drafts nothing; records the target features each session is handed."""

    name = "features"
    needs_target_features = True

    def __init__(self) -> None:
        self.seen = {}

    def start(self, prompt_ids, sampling):
        recorder = self

        class Session:
            def propose(self, context, max_tokens, generator):
                features = recorder.seen.setdefault(tuple(prompt_ids), [])
                assert context.features_start == sum(len(f) for f in features)
                assert context.features_start + len(context.target_features) == len(context.token_ids) - 1
                features.append(context.target_features)
                return Proposal(tokens=[], probs=None)

            def close(self):
                pass

        return Session()


def test_batched_rows_hand_drafters_the_same_features_as_the_engine(target):
    prompts = [[5, 6, 7, 8, 9], [11, 12], list(range(30, 50))]
    alone, batched = FeatureRecorder(), FeatureRecorder()
    for prompt in prompts:
        SpeculativeDecoder(target, alone, gamma=2).generate(prompt, 10)
    # Drafting in every round, however many rows share it (the default policy drafts for a lone request only).
    scheduler = Scheduler(target.model, batched, target.tokenizer, SchedulerConfig(gamma=2, gamma_policy=BatchGammaPolicy(full_until=8, off_from=40)))
    events = [queue.Queue() for _ in prompts]
    try:
        for prompt, sink in zip(prompts, events):
            scheduler.submit(GenerationRequest(prompt, 10, SamplingParams(), [], sink.put))
        for sink in events:
            while sink.get(timeout=30).finish_reason is None:
                pass
    finally:
        scheduler.stop()
    for prompt in prompts:
        expected, got = torch.cat(alone.seen[tuple(prompt)]), torch.cat(batched.seen[tuple(prompt)])
        assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-4)


def test_admission_takes_waiting_requests_in_order_within_the_prefill_budget():
    from verispec.serving.scheduler import admission_count

    assert admission_count([900, 900, 900], room=8, prefill_budget=2048) == 2  # a third would pass 2,048
    assert admission_count([3000, 10, 10], room=8, prefill_budget=2048) == 1  # the first always comes in
    assert admission_count([10] * 50, room=32, prefill_budget=2048) == 32  # the batch's room bounds it too
    assert admission_count([3000] * 5, room=4, prefill_budget=0) == 4  # 0: every request that fits
    assert admission_count([], room=4, prefill_budget=2048) == admission_count([5], room=0, prefill_budget=2048) == 0
    assert SchedulerConfig().prefill_budget == _build_serve_defaults().prefill_budget == 2048
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prefill_budget must be an integer >= 0"):
            SchedulerConfig(prefill_budget=bad)


def _build_serve_defaults():
    from verispec.cli import _build_parser

    return _build_parser().parse_args(["serve"])


@pytest.mark.parametrize("prefill_budget", [0, 30])
def test_long_prompts_arriving_together_join_one_round_apart_within_the_budget(target, prefill_budget):
    # A running request (its first round holds the scheduler inside its sink while three 20-token
    # prompts queue up), then the three: with a 30-token budget each joins at its own round, so the
    # first newcomer answers before the others are prefilled; with no budget all join at once.
    log: list[str] = []
    release = threading.Event()

    def sink_of(name: str):
        def sink(step):
            log.append(name)
            if name == "running" and not release.is_set():
                release.wait(30)
        return sink

    scheduler = Scheduler(target.model, None, target.tokenizer, SchedulerConfig(prefill_budget=prefill_budget))
    try:
        scheduler.submit(GenerationRequest([5, 6, 7], 40, SamplingParams(), [], sink_of("running")))
        while not log:
            time.sleep(0.01)
        for name in ("a", "b", "c"):
            scheduler.submit(GenerationRequest(list(range(10, 30)), 3, SamplingParams(), [], sink_of(name)))
        release.set()
        while len(log) < 9 + 4:
            time.sleep(0.01)
    finally:
        release.set()
        scheduler.stop()
    joined_at = [log[: log.index(name)].count("running") for name in ("a", "b", "c")]  # rounds of the running request before each first token
    assert joined_at == ([2, 2, 2] if prefill_budget == 0 else [2, 3, 4])


def test_gamma_policy_tapers_with_the_batch_and_refuses_bad_bounds():
    policy = BatchGammaPolicy(full_until=4, off_from=16)
    gammas = [policy.gamma_for(batch, 6) for batch in range(1, 20)]
    assert gammas[:4] == [6] * 4 and gammas[15:] == [0] * 4
    assert all(later <= earlier for earlier, later in zip(gammas, gammas[1:]))  # never more drafts for a bigger batch
    assert all(1 <= gamma <= 6 for gamma in gammas[4:15]) and gammas[9] == 3  # batch 10: half-way, half of gamma
    default = BatchGammaPolicy()  # measured (README): full gamma to 4 requests, none from 16
    assert [default.gamma_for(batch, 6) for batch in (1, 4, 10, 16)] == [6, 6, 3, 0]
    from verispec.cli import _build_parser

    serve = _build_parser().parse_args(["serve"])  # the CLI's defaults are the policy's
    assert (serve.gamma_full_batch, serve.gamma_off_batch) == (default.full_until, default.off_from)
    with pytest.raises(ValueError, match="off_from"):
        BatchGammaPolicy(full_until=4, off_from=4)
    with pytest.raises(ValueError, match="full_until"):
        BatchGammaPolicy(full_until=0)


def test_rolling_acceptance_is_exposed_per_scope_and_requests_are_forgotten(draft_server, plain_server):
    draft_server.client().completions.create(model=MODEL, prompt="hello world", max_tokens=12, temperature=0)
    values = _metrics(draft_server)
    for scope in ("global", "key:anonymous"):
        alpha = values[("verispec_rolling_acceptance_rate", (("scope", scope),))]
        tau = values[("verispec_rolling_tokens_per_call", (("scope", scope),))]
        assert 0.0 <= alpha <= 1.0 and tau >= 1.0
    monitor = draft_server.app.state.scheduler.monitor
    _wait_for(lambda: draft_server.app.state.scheduler.running == 0)
    assert sorted(monitor.scopes()) == ["global", "key:anonymous"]  # finished requests' scopes are gone
    # Behind an API key the key's scope is a short hash, never the key itself.
    headers = {"Authorization": f"Bearer {KEY}"}
    plain_server.client(KEY).completions.create(model=MODEL, prompt="hello world", max_tokens=4, temperature=0)
    text = httpx.get(f"{plain_server.url}/metrics", headers=headers).text
    assert KEY not in text and 'verispec_rolling_tokens_per_call{scope="key:' in text


def _run_alone(scheduler, prompt, max_tokens, sampling):
    events = queue.Queue()
    scheduler.submit(GenerationRequest(prompt, max_tokens, sampling, [], events.put))
    tokens, step = [], None
    while step is None or step.finish_reason is None:
        step = events.get(timeout=60)
        tokens += step.token_ids
    return tokens, step.stats


@pytest.mark.parametrize("control", ["adaptive", "fixed"])
def test_a_request_the_drafter_cannot_follow_is_decoded_plainly_unless_gamma_is_fixed(target, control):
    anti = DraftModel(anti_copy(target.model))  # its top tokens are the target's least likely: nothing is accepted
    config = SchedulerConfig(gamma=4, adaptive_gamma=control == "adaptive")
    scheduler = Scheduler(target.model, anti, target.tokenizer, config)
    prompt = [5, 6, 7, 8, 9]
    try:
        tokens, stats = _run_alone(scheduler, prompt, 48, SamplingParams())
        _, seeded = _run_alone(scheduler, prompt, 12, SamplingParams(temperature=0.8, seed=3))
    finally:
        scheduler.stop()
    assert tokens == SpeculativeDecoder(target).generate(prompt, 48, stop=[]).token_ids  # exact either way
    drafting_rounds = sum(1 for drafted in stats.drafted_per_round if drafted)
    if control == "fixed":
        assert all(drafted > 0 for drafted in stats.drafted_per_round[:-1])
    else:  # the controller gives up after a few rejected rounds and only probes now and then
        assert drafting_rounds <= len(stats.drafted_per_round) // 3, stats.drafted_per_round
    # A seeded request is never controlled: its random stream must not depend on timings.
    assert all(drafted > 0 for drafted in seeded.drafted_per_round[:-1])


def test_the_configured_floor_warns_for_the_request_its_key_and_the_server(target, caplog):
    import json
    import logging

    from verispec.engine.monitor import MonitorConfig

    # plain_step_s 1 s: any real speed is far below a floor of 10^6 x plain decoding.
    monitor = MonitorConfig(window=8, min_rounds=4, speedup_floor=1e6, plain_step_s=1.0)
    config = SchedulerConfig(gamma=2, adaptive_gamma=False, monitor=monitor)
    scheduler = Scheduler(target.model, DraftModel(anti_copy(target.model)), target.tokenizer, config)
    assert scheduler.monitor.config is monitor
    try:
        with caplog.at_level(logging.WARNING, logger="verispec.monitor"):
            _run_alone(scheduler, [5, 6, 7, 8, 9], 12, SamplingParams())
    finally:
        scheduler.stop()
    events = [json.loads(record.message) for record in caplog.records if record.name == "verispec.monitor"]
    assert {event["scope"].split(":")[0] for event in events} == {"global", "key", "request"}
    assert all(event["event"] == "speculation_below_floor" and event["speedup_floor"] == 1e6 for event in events)

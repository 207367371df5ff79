"""The weight-transfer endpoints' trust model: an init may name only an allowed trainer
host (403 before any connection otherwise), and an init nobody answers is a 504 naming the
address, the timeout and the fix, after which the server is healthy and a later init works."""

from __future__ import annotations

import re
from datetime import timedelta

import httpx
import pytest

from tandem.cli import build_parser
from tandem.cli.arguments import config_from_arguments
from tandem.rollout.serving import engine_core
from tandem.rollout.serving.allowed_hosts import AllowedHosts
from tandem.rollout.serving.client import TandemClient
from tandem.rollout.serving.config import ServerConfig
from tests.test_server import API_KEY, CONTROL_AUTH, CONTROL_KEY, HOST, running_server
from tests.test_sync_distributed import BUCKET_BYTES, free_port
from tests.test_weight_update import GREEDY, PROMPTS, trainer_model

TIMEOUT_SECONDS = 2.0


def init_info(master_address: str, master_port: int) -> dict:
    return {"init_info": {"master_address": master_address, "master_port": master_port,
                          "rank_offset": 1, "world_size": 2}}


@pytest.mark.parametrize("address, allowed", [
    ("127.0.0.1", True), ("::1", True), ("localhost", True), ("LocalHost", True),
    ("127.0.0.2", False), ("10.0.0.5", False), ("::ffff:127.0.0.1", False),
    ("localhost.", False), ("trainer", False), ("", False),
])
def test_the_default_allows_this_machine_only(address, allowed):
    assert AllowedHosts.parse(ServerConfig().weight_transfer_allowed_hosts).allows(address) \
        is allowed


@pytest.mark.parametrize("address, allowed", [
    ("10.0.0.1", True), ("10.255.255.255", True), ("11.0.0.1", False),
    ("fd12::7", True), ("fe80::1", False), ("Trainer-0.cluster", True), ("trainer-1", False),
    ("192.168.1.20", True), ("192.168.1.21", False),
])
def test_named_hosts_and_networks_allow_only_themselves(address, allowed):
    hosts = AllowedHosts.parse("10.0.0.0/8, fd00::/8,trainer-0.cluster,192.168.1.20")
    assert hosts.allows(address) is allowed


def test_a_star_allows_any_host():
    assert all(AllowedHosts.parse("*").allows(a) for a in ("10.1.2.3", "evil.example", "::"))


@pytest.mark.parametrize("spec, reason", [
    ("", "names no host"), (" , ", "an empty entry"), ("127.0.0.1,", "an empty entry"),
    ("10.0.0.1/8", "is not an IP network"), ("10.0.0.0/33", "is not an IP network"),
    ("::1::2", "is not an IP network"), ("256.1.1.1", "neither an IP address nor a host name"),
    ("http://trainer", "is not an IP network"), ("bad host", "neither an IP address"),
])
def test_a_malformed_allowed_hosts_option_is_refused_naming_the_field(spec, reason):
    prefix = re.escape(f"weight_transfer_allowed_hosts={spec!r} is invalid: ")
    with pytest.raises(ValueError, match=f"{prefix}.*{re.escape(reason)}"):
        ServerConfig(weight_transfer_allowed_hosts=spec)


def test_serve_takes_the_allowed_hosts_on_its_command_line(llama_dir):
    args = build_parser().parse_args(["serve", str(llama_dir), "--weight-transfer-allowed-hosts",
                                      "10.0.0.0/8,trainer"])
    assert config_from_arguments(ServerConfig, args).weight_transfer_allowed_hosts == \
        "10.0.0.0/8,trainer"


def test_an_init_naming_a_host_not_allowed_is_refused_before_connecting(llama_dir,
                                                                        monkeypatch):
    joined = []
    monkeypatch.setattr(engine_core, "WeightReceiver", lambda *args: joined.append(args))
    with running_server(llama_dir, enable_weight_transfer=True, control_api_key=CONTROL_KEY,
                        weight_transfer_allowed_hosts="127.0.0.1,10.0.0.0/8") as (url, _):
        refused = httpx.post(f"{url}/init_weight_transfer_engine", headers=CONTROL_AUTH,
                             json=init_info("192.168.7.7", 29500), timeout=30)
        allowed = httpx.post(f"{url}/init_weight_transfer_engine", headers=CONTROL_AUTH,
                             json=init_info("10.1.2.3", 29500), timeout=30)
    assert refused.status_code == 403
    error = refused.json()["error"]
    assert "master_address '192.168.7.7' is not among" in error["message"]
    assert "--weight-transfer-allowed-hosts" in error["message"]
    assert (error["param"], error["code"]) == ("master_address",
                                               "weight_transfer_host_not_allowed")
    assert allowed.status_code == 200 and [args[1:3] for args in joined] == [("10.1.2.3",
                                                                              29500)]


def test_an_init_nobody_answers_is_a_504_and_a_later_init_succeeds(llama_dir):
    port = free_port()
    with running_server(llama_dir, enable_weight_transfer=True, control_api_key=CONTROL_KEY,
                        weight_transfer_timeout=TIMEOUT_SECONDS) as (url, engine):
        answer = httpx.post(f"{url}/init_weight_transfer_engine", headers=CONTROL_AUTH,
                            json=init_info(HOST, port), timeout=60)
        health = httpx.get(f"{url}/health", timeout=30)
        client = TandemClient(url, api_key=API_KEY, control_api_key=CONTROL_KEY)
        client.init_weight_transfer(bucket_bytes=BUCKET_BYTES, timeout=timedelta(seconds=30))
        state = trainer_model(llama_dir, seed=4).state_dict()
        version = client.update_weights(state.items())
        outputs = client.generate(PROMPTS, GREEDY)
    assert answer.status_code == 504
    error = answer.json()["error"]
    assert error["type"] == "timeout"
    for part in (f"{HOST}:{port}", f"within {TIMEOUT_SECONDS:g} s", "WeightSender",
                 "--weight-transfer-timeout"):
        assert part in error["message"]
    assert health.status_code == 200
    assert version == 1 == engine.weight_version
    assert all(o.outputs[0].weight_versions == (1, 1) for o in outputs)

"""The KV connector seam without a model: the registry and `kv_connector_module_path`,
MultiConnector's composition rules (first child with a match loads, None means ask again,
params merged, a clash refused, hooks fanned out), and `--kv-transfer-config` checks."""

from __future__ import annotations

from typing import Any

import pytest

from sous.config.errors import ConfigError
from sous.engine.request import Request
from sous.engine.sampling_params import SamplingParams
from sous.kv_transfer.base import KVConnectorBase, KVConnectorContext, KVConnectorRole
from sous.kv_transfer.config import KVTransferConfig
from sous.kv_transfer.factory import check_connector_name, create_connector
from sous.kv_transfer.multi import MultiConnector

CONTEXT = KVConnectorContext(model_name="m", kv_cache_spec=None, block_size=16)


class FixedConnector(KVConnectorBase):
    """Matches `extra.match` tokens (None: undecided), returns `extra.params` at finish,
    records the calls it gets."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole,
                 context: KVConnectorContext) -> None:
        super().__init__(config, role, context)
        self.extra = config.kv_connector_extra_config
        self.calls: list[tuple[str, Any]] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        return self.extra.get("match", 0), False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens) -> None:
        self.calls.append(("alloc", num_external_tokens))

    def request_finished(self, request, block_ids):
        return bool(self.extra.get("delay")), self.extra.get("params")

    def save_kv_layer(self, kv_cache) -> None:
        self.calls.append(("save_layer", kv_cache))

    def get_load_errors(self) -> dict[str, int]:
        return dict(self.extra.get("errors", {}))


def child(**extra: Any) -> dict[str, Any]:
    return {"kv_connector": "FixedConnector", "kv_connector_module_path": __name__,
            "kv_connector_extra_config": extra}


def multi(*children: dict[str, Any]) -> MultiConnector:
    config = KVTransferConfig.from_dict({"kv_connector": "MultiConnector", "kv_role": "kv_both",
                                         "kv_connector_extra_config":
                                             {"connectors": list(children)}})
    connector = create_connector(config, KVConnectorRole.SCHEDULER, CONTEXT)
    assert isinstance(connector, MultiConnector)
    return connector


def request() -> Request:
    return Request("r", list(range(40)), SamplingParams(max_tokens=4), frozenset(), 4)


def test_first_child_with_a_match_loads_and_the_others_get_zero() -> None:
    m = multi(child(match=0), child(match=32), child(match=16))
    assert m.get_num_new_matched_tokens(request(), 0) == (32, False)
    m.update_state_after_alloc(request(), [1, 2, 3], 32)
    assert [c.calls for c in m.children] == [[("alloc", 0)], [("alloc", 32)], [("alloc", 0)]]


def test_an_undecided_child_makes_the_answer_undecided() -> None:
    assert multi(child(match=16), child(match=None)).get_num_new_matched_tokens(
        request(), 0) == (None, False)


def test_finish_merges_params_delays_if_any_child_does_and_refuses_a_clash() -> None:
    m = multi(child(params={"a": 1}), child(delay=True, params={"b": 2}))
    assert m.request_finished(request(), []) == (True, {"a": 1, "b": 2})
    with pytest.raises(RuntimeError, match=r"\['a'\] set by two connectors"):
        multi(child(params={"a": 1}), child(params={"a": 2})).request_finished(request(), [])


def test_hooks_fan_out_and_load_errors_keep_the_shortest_valid_prefix() -> None:
    m = multi(child(errors={"r": 64}), child(errors={"r": 32, "s": 16}))
    m.save_kv_layer("layer0")  # type: ignore[arg-type]
    assert all(c.calls == [("save_layer", "layer0")] for c in m.children)
    assert m.get_load_errors() == {"r": 32, "s": 16}


@pytest.mark.parametrize(("config", "message"), [
    ({"kv_connector": "Nope", "kv_role": "kv_both"}, "unknown kv_connector 'Nope'"),
    ({"kv_connector": "MultiConnector", "kv_role": "kv_both"},
     "needs kv_connector_extra_config.connectors"),
    ({"kv_connector": "X", "kv_role": "kv_both", "kv_connector_module_path": "no.such.mod"},
     "kv_connector_module_path 'no.such.mod' cannot be imported"),
    ({"kv_connector": "Request", "kv_role": "kv_both", "kv_connector_module_path": __name__},
     "has no KV connector class 'Request'"),
])
def test_bad_connector_configs_name_the_problem(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_connector_name(KVTransferConfig.from_dict(config))
    if config["kv_connector"] != "MultiConnector":
        with pytest.raises(ConfigError, match=message):
            create_connector(KVTransferConfig.from_dict(config), KVConnectorRole.WORKER, CONTEXT)

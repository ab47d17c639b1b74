"""The OasisKV KV connector: it carries vLLM's request lifecycle from the scheduler to the workers.

The scheduler side turns each step's ``SchedulerOutput`` into ``OasisKVConnectorMetadata``: the blocks each
request was given (the worker finds a forward's requests by them), new prompts' lengths, the requests that
finished or were aborted, preempted ones and resumed ones. The worker side hands it to the worker state
(runtime.py) before the step runs (``handle_preemptions``, which vLLM calls first in every step). No KV moves
through the connector: OasisKV holds it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from . import runtime
from .settings import Settings


@dataclass
class OasisKVConnectorMetadata(KVConnectorMetadata):
    blocks: dict = field(default_factory=dict)  # request id -> vLLM block ids it was given this step
    prompt_lens: dict = field(default_factory=dict)  # request id -> prompt tokens (new requests)
    finished: set = field(default_factory=set)  # finished or aborted (their sequences are removed)
    restarted: set = field(default_factory=set)  # preempted or resumed (they prefill again)
    scheduled_tokens: int = 0


class OasisKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._settings = Settings.of(vllm_config)
        self._vllm_config = vllm_config

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return

    def build_connector_meta(self, scheduler_output):
        meta = OasisKVConnectorMetadata(scheduled_tokens=int(scheduler_output.total_num_scheduled_tokens))
        for new in scheduler_output.scheduled_new_reqs:
            meta.blocks[new.req_id] = list(new.block_ids[0]) if new.block_ids else []
            tokens = new.prompt_token_ids
            meta.prompt_lens[new.req_id] = len(tokens) if tokens is not None else 0
        cached = scheduler_output.scheduled_cached_reqs
        for req, blocks in zip(cached.req_ids, cached.new_block_ids):
            if blocks:
                meta.blocks[req] = list(blocks[0])
        meta.restarted |= set(getattr(cached, "resumed_req_ids", None) or ())
        meta.restarted |= set(scheduler_output.preempted_req_ids or ())
        meta.finished |= set(scheduler_output.finished_req_ids)
        return meta

    def request_finished(self, request, block_ids):
        return False, None

    # ---- worker side ----

    def handle_preemptions(self, kv_connector_metadata):
        if self._settings is None:
            return
        runtime.state_for(self._vllm_config, self._settings).begin_step(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs):
        return

    def wait_for_layer_load(self, layer_name):
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return

    def wait_for_save(self):
        return

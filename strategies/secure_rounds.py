"""Secure sums over Flower's Message API: the transport of ``secure_sum.session`` (a thin adapter).

Each stage of a secure sum is one exchange of ``train.secagg`` messages: the request travels as a
JSON string (``session.encode``) in the ``secagg`` ConfigRecord, its arrays (a server basis, a masked
vector) in the ``secagg-arrays`` ArrayRecord; a reply comes back the same way. The silo side is
``client_app.app.secure_sum_stage``. An error reply, a missing or malformed reply is a dropout of
that client at that stage, which the protocol tolerates up to its threshold.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from .secure_sum.session import decode, encode

MESSAGE_TYPE = "train.secagg"
REQUEST_RECORD, ARRAYS_RECORD, REPLY_KEY = "secagg", "secagg-arrays", "payload"


def content_bytes(content: RecordDict) -> int:
    return sum(record.count_bytes() for record in content.values())


def pack(payload) -> RecordDict:
    """A payload as a message's content."""
    text, arrays = encode(payload)
    content = RecordDict({REQUEST_RECORD: ConfigRecord({REPLY_KEY: text})})
    if arrays:
        content[ARRAYS_RECORD] = ArrayRecord({name: Array(np.ascontiguousarray(a)) for name, a in arrays.items()})
    return content


def unpack(content: RecordDict):
    """A message's content back into a payload; raises ``ValueError`` if it carries none."""
    if REQUEST_RECORD not in content.config_records:
        raise ValueError("the message carries no secure-sum payload")
    record = content.array_records.get(ARRAYS_RECORD)
    arrays = {name: record[name].numpy() for name in record} if record is not None else {}
    return decode(str(content.config_records[REQUEST_RECORD][REPLY_KEY]), arrays)


def message_transport(grid, timeout: float | None, exchange, counters: dict | None = None):
    """The transport of ``session.run_secure_sum`` over ``grid`` (``exchange`` pushes and pulls:
    ``strategies.flower.exchange``). ``counters["bytes_down"]`` adds up what the server sends."""
    counters = counters if counters is not None else {}

    def transport(stage, requests):
        messages = []
        for node, request in requests.items():
            content = pack(request)
            counters["bytes_down"] = counters.get("bytes_down", 0) + content_bytes(content)
            messages.append(Message(content=content, dst_node_id=int(node), message_type=MESSAGE_TYPE))
        out = {}
        for reply in exchange(grid, messages, timeout):
            node = int(reply.metadata.src_node_id)
            if node not in requests:
                continue
            if reply.has_error():
                out[node] = RuntimeError(f"error reply (code {reply.error.code}): {reply.error.reason}")
                continue
            try:
                out[node] = unpack(reply.content)
            except Exception as exc:  # a malformed reply: a dropout with its reason
                out[node] = exc
        return out

    return transport


def train_reply_payloads(replies) -> dict:
    """The first sum's stage-1 replies carried by train replies: {node: payload or an Exception}."""
    out = {}
    for msg in replies:
        node = int(msg.metadata.src_node_id)
        if msg.has_error():
            out[node] = RuntimeError(f"error reply (code {msg.error.code}): {msg.error.reason}")
            continue
        try:
            out[node] = unpack(msg.content)
        except Exception as exc:
            out[node] = exc
    return out

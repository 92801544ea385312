"""LMCache's disaggregated prefill (`LMCacheConnectorV1` with `enable_pd`): the prefiller pushes the KV.

See docs/connectors.md, "LMCache PD". The prefill hop is a `/v1/completions` call with the prompt as token
ids, one token, and a `disagg_spec` naming the decoder's LMCache receiver (its host, and one init
and one alloc port per decoder TP rank). The prefiller answers with the first token
(`kv_transfer_params.first_tok`) and, once the KV has landed in the decoder's buffer, each of its
workers pushes a msgpack `{"type": "ProxyNotif", "req_id": R}` to the router's ZMQ PULL socket.
Only then is the KV staged. The decoder gets a plain completion of `prompt + [first_tok]` for the
remaining tokens, and the client gets the first token at once, then the decoder's continuation in
the API it asked for (chat chunks are rebuilt from completion chunks).

The decoder's LMCache receive buffer never evicts: pushed KV leaves it only when a decode call
retrieves it, and a full buffer blocks every prefiller pushing to that decoder. So KV that no decode
call will pick up (the first token already ended the answer, the client left, the decoder could not
be reached) is drained: the decoder is asked for one token of the continuation, and the answer dropped.
"""

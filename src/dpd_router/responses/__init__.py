"""The OpenAI Responses API in one place: what the router reads of a body and the conversation the engine
renders of it (api), the history the router keeps and expands `previous_response_id` from (history), and
where stored responses are kept (store). Its wire format, as the relay reads it, is wires.RESPONSES_WIRE."""

"""Anthropic's Messages API: what the router reads of a body and the chat conversation the engine renders of
it, its usage and its errors (api). Its wire format, as the relay reads it, is wires.MESSAGES_WIRE."""

"""Reading a prompt: the model's tokenizer and the reader that encodes a prompt only as far as a decision
needs (tokenizer), the chat template's inputs and its shortcut render (chat_inputs, chat_render), the
sandbox a client's template renders in (template_sandbox), and the context window's check (context_window)."""

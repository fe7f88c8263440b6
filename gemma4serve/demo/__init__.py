"""The built-in demo model and the tests' checkpoints: tiny random Gemma 4 targets and assistants
(`checkpoints`), their tokenizer (`tokenizer`) and chat template (`chat_template.jinja`)."""

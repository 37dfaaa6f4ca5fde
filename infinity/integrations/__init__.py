"""Small adapters for other libraries, where a wrapped model cannot behave natively.

Hugging Face Trainer, accelerate and Lightning need none (see README, "Using infinity with
other trainers"); PEFT needs :func:`infinity.integrations.peft.merge_and_unload`.
"""

"""LoRA adapters: several fine-tunes of the served model, chosen per request (issue 34).

adapter.py reads PEFT's format, adapter_store.py keeps adapters in memory, lora_linear.py
applies them per row, lora_slots.py places them in the model's slots; the design is in
docs/architecture.md, "LoRA adapters".
"""

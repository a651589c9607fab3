"""Training job: data preparation, tokenizer, Lightning fine-tuning of a Llama-shaped family."""

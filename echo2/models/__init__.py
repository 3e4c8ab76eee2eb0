"""The model side that node and hub share: torch/transformers plumbing (tokenizer, model from a
config, reference log-probs), the state dict <-> packed bytes conversion, and the engines."""

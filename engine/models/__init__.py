"""Model families. Each model's parameter names mirror its HF checkpoint's tensor names."""

"""Graph nodes (ComfyUI V1 conventions), each beside its VRAM estimate."""

"""Drawing a plan: the timeline SVG that `vramgraph plan --svg`, the web page and the ComfyUI panel show."""

"""The local server: ComfyUI's HTTP and websocket API plus the plan page (`vramgraph serve`).

`app.py` builds the aiohttp application, `routes.py` answers the requests, `queue.py` holds the prompt
queue and the worker that runs it, `hub.py` sends websocket events, `formats.py` shapes responses,
`bodies.py` checks what requests carry (4xx in ComfyUI's error shape), `security.py` keeps the server safe
beside a browser (origin checks, safe file serving, image-only uploads). Beyond one machine, `broker.py` makes
the server a frontend that publishes prompts to RabbitMQ and `fleet_worker.py` is `vramgraph worker`, which runs
them (aio-pika, the optional extra `broker`, is imported only there).
"""

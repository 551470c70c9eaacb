"""``dyngen serve --replicas N``: several engines behind one OpenAI-compatible endpoint, on Ray
Serve, with requests routed to the replica whose prompt cache most likely holds their prefix.

Optional: it needs the ``replicas`` extra (``pip install 'dyngen-core[replicas]'``: Ray Serve,
beside the ``serve`` extra). Only `router`, `deployment` and `cluster` import Ray, and nothing
outside this package imports them, so ``dyngen_core`` stays importable without Ray.

Modules: `options` (how replicas run, and the command-line arguments; no Ray), `prefixes`
(per replica, a bounded record of the page hashes routed there; no Ray), `forwarding` (an HTTP
request carried to a replica and answered by dyngen's own server application in-process; no
Ray), `prompts` (a forwarded request's prompt ids, rendered as the server renders them; no Ray,
no torch), `router` (Ray Serve request routers: `PageHashRouter`, `RoundRobinRouter`),
`deployment` (the engine replica and ingress deployments, `build_replicas_app`) and `cluster`
(connecting to Ray and serving until interrupted).
"""

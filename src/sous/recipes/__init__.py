"""Vendor recipes (issue 3): read, plan, check and launch the deployments a recipe page describes.

Modules (one noun each): `schema` (pydantic models of the format), `catalog` (shipped recipes,
load by stem or path), `compose` (selection -> processes), `render` (shell, JSON), `k8s`
(Kubernetes YAML), `archs` (public model architecture numbers), `fit` (memory fit arithmetic),
`check` (fit of a plan or model, and its report), `page` (`list`/`show` text), `launch` and
`supervise` (the topology on this machine with a stand-in model), `cli` (`sous recipe ...`).
Nothing is imported here, so `sous recipe` stays fast.
"""

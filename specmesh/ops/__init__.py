"""Operator tooling: what a person (or a container probe, a benchmark, a test) runs from outside the services. The
`specmesh` command (`cli`, and `cli_output`: what it prints), the launcher that starts the three services as child
processes (`launcher`), the declarative pipeline file (`pipeline_file` parses it, `pipeline_map` maps it to flags
and requests, `pipeline_cli` runs it), the small public-API client (`client`) and the grpc.health.v1 probe
(`healthcheck`). It sits on top of everything else in specmesh; no service imports it.
"""

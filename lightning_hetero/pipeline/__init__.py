"""The floor the pipeline methods stand on (subspace pipeline, decoupled layerwise training), framework-free.

- :mod:`.layout`: which rank runs which stage (:class:`~.layout.PipelineLayout`), the process groups that follow
  (:class:`~.layout.PipelineGroups`) and the balanced layer split (:func:`~.layout.split_layers`);
- :mod:`.codec`: the boundary codec (:class:`~.codec.BoundaryCodec`, fp32/bf16/int8 activations both ways);
- :mod:`.stage_gather`: every stage's state to rank 0 for export, bounded and decoded without unpickling.
- :mod:`.settings`: :class:`~.settings.PipelineSettings`, the stages/replicas/boundary-codec settings both
  strategies' settings hold as their ``pipeline`` field.

Nothing here imports Lightning or a method package.
"""

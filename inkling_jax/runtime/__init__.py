"""The one batcher under every front door: requests (one type, validated once), the scheduler, the engine
(state on the mesh, compiled steps), streamed text, the batch runner and the compilation cache."""

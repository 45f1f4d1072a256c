"""compile_log counts the XLA programs a process obtains, and those the persistent cache served."""
import jax
import jax.numpy as jnp

from jaxprefix import compile_log


def test_counts_compiles_once_and_cache_hits_after_the_in_memory_cache_is_cleared(tmp_path):
    compile_log.install()
    compile_log.install()  # a second install counts nothing twice
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    saved = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    x = jnp.arange(5.0)  # its own programs obtained before the readings
    try:
        def f(v):
            return jnp.sin(v) * 3 + 1

        before = compile_log.totals()
        jax.jit(f)(x).block_until_ready()
        first = compile_log.totals().minus(before)
        assert first.programs == 1 and first.cache_hits == 0 and first.seconds > 0
        assert "1 compiled" in first.describe()

        before = compile_log.totals()
        jax.jit(f)(x).block_until_ready()  # the same program: nothing obtained again
        assert compile_log.totals().minus(before).metrics() == {
            "time/compile": 0.0, "time/compiled_programs": 0, "time/cached_programs": 0}

        jax.clear_caches()  # a new process, as far as the in-memory caches go
        before = compile_log.totals()
        jax.jit(f)(x).block_until_ready()
        again = compile_log.totals().minus(before)
        assert again.programs == 1 and again.cache_hits == 1
        assert "0 compiled, 1 served by the persistent compilation cache" in again.describe()
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)

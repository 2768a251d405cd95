//! What the engines hold, for up-front memory estimates: the only facts
//! about the machinery behind [`crate::fast`]'s wall that a caller needs
//! (verify's memory estimate of a case; the GPU's naive engine, which
//! checkpoints on the CPU's spacing).

/// Working buffers each thread keeps for reuse between (sequence, head)
/// pairs: at most this many, of at most [`MAX_KEPT`] bytes each.
pub const KEPT: usize = crate::fast::scratch::KEPT;

/// The largest working buffer a thread keeps for reuse, in bytes.
pub const MAX_KEPT: usize = crate::fast::scratch::MAX_KEPT;

/// Tokens per span of a chunked engine's long (sequence, head) pair: a
/// longer pair's forward+backward holds one span's intermediates at a time.
pub const SPAN_LEN: usize = crate::fast::spans::SPAN_LEN;

/// Tokens per block of a checkpointed naive backward of `l` tokens at the
/// `O(√L · K · V)` spacing: `⌈√l⌉`, at least 16. (The CPU engines shorten
/// it where a block of states would not fit the cache: [`held_states`].)
pub fn block_len(l: usize) -> usize {
    crate::fast::sweep::block_len(l)
}

/// `[K, V]` states of `state_bytes` each that a naive engine's
/// checkpointed backward of `l` tokens holds at once: its checkpoints and
/// one block of replayed states.
pub fn held_states(l: usize, state_bytes: usize) -> usize {
    crate::fast::sweep::held_states(l, state_bytes)
}

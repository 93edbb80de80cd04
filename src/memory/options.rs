//! What the user asked about memory, as meaning rather than flags: the device rules act on it,
//! the placement of every component and the memory plan read it.

use serde::Serialize;

/// The memory options of a run. Field names are the options' config-file keys, so a rule's
/// change is reported under the name the user wrote.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryOptions {
    /// Every DiT's weights wait in host memory when it is not computing.
    pub dit_cpu_offload: bool,
    /// The DiT is sharded across GPUs.
    pub use_fsdp_inference: bool,
    /// Every DiT's blocks stream from host memory (over `dit_cpu_offload`).
    pub dit_layerwise_offload: bool,
    /// Of each streamed DiT, up to this many bytes of blocks stay on the device through a stage
    /// (spread through the pass, copied once); the rest stream every step.
    pub dit_resident_memory: u64,
    pub text_encoder_cpu_offload: bool,
    pub image_encoder_cpu_offload: bool,
    pub vae_cpu_offload: bool,
    /// Offloaded weights are held in page-locked memory.
    pub pin_cpu_memory: bool,
    /// At most this many bytes pinned (weights then stream through a pinned staging ring).
    pub max_pinned_memory: Option<u64>,
    /// An offloaded text encoder computes on the CPU instead of streaming to the device.
    pub text_encoder_on_cpu: bool,
    /// Components load on first use and free after their last stage; `None`: the device decides.
    pub lazy_module_load: Option<bool>,
    /// The first stage's components load, run and free before the rest; `None`: the device decides.
    pub h3_sequential_load: Option<bool>,
    /// Stream each step of a block as its own group (diffusers' leaf level).
    pub leaf_level: bool,
    pub num_blocks_per_group: usize,
    /// Prefetch on a copy stream (off: synchronous copies).
    pub offload_stream: bool,
    /// Groups the copy stream runs ahead; `None`: 1, and for step-by-step streaming as many
    /// steps as make the smallest block.
    pub prefetch_depth: Option<usize>,
    /// diffusers' whole-component offload.
    pub model_cpu_offload: bool,
    /// diffusers' sequential offload: step by step, synchronous copies.
    pub sequential_cpu_offload: bool,
    /// The VAE decodes in spatial tiles.
    pub vae_tiling: bool,
    /// Tiles of this many pixels (every three quarters of it) instead of the VAE's default
    /// (the Wan family; with `vae_tiling`).
    pub vae_tile_size: Option<u32>,
    /// The DiT's blocks run by chunks of tokens written over the hidden states: less activation
    /// memory, the same arithmetic per token (the Wan family).
    pub low_activation: bool,
}

impl MemoryOptions {
    /// Whole blocks (or groups, or gathered FSDP blocks) the copy stream runs ahead: as asked,
    /// else 1.
    pub fn block_depth(&self) -> usize {
        self.prefetch_depth.unwrap_or(1)
    }

    /// Whether components load late and free early (after the device rules: `auto` is off).
    pub fn lazy(&self) -> bool {
        self.lazy_module_load == Some(true)
    }

    /// Whether the first stage's components run and free before the rest load.
    pub fn sequential(&self) -> bool {
        self.h3_sequential_load == Some(true)
    }
}

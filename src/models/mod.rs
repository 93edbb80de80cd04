//! Model families, and how their files and weights are found. Models expose their blocks and
//! know nothing of offloading.

pub mod allegro;
pub mod attention;
#[cfg(feature = "cuda")]
#[path = "kernels/audio_ops.rs"]
pub(crate) mod audio_ops;
pub mod autoencoder_kl;
pub mod blocks;
#[cfg(all(test, feature = "cuda"))]
#[path = "kernels/candle_strided.rs"]
mod candle_strided;
#[cfg(feature = "cuda")]
#[path = "kernels/channel_ops.rs"]
pub(crate) mod channel_ops;
pub mod clip;
pub mod cogvideox;
pub mod config_checks;
pub mod conv3d;
#[cfg(feature = "cuda")]
pub mod cudnn;
pub mod flux;
pub mod fp8;
#[cfg(feature = "cuda")]
#[path = "kernels/fp8.rs"]
pub mod fp8_kernels;
#[cfg(feature = "cuda")]
#[path = "kernels/fp8_sm90.rs"]
pub mod fp8_sm90;
pub mod guidance;
pub mod hunyuan_video;
#[cfg(feature = "cuda")]
#[path = "kernels/module.rs"]
pub(crate) mod kernel_module;
pub mod latte;
#[cfg(feature = "cuda")]
#[path = "kernels/linear.rs"]
pub(crate) mod linear;
pub mod ltx;
pub mod minimax_h3;
pub mod mochi;
#[cfg(feature = "cuda")]
#[path = "kernels/norms.rs"]
pub(crate) mod norms;
pub mod patches;
pub mod pixart;
pub mod projection;
#[cfg(feature = "cuda")]
#[path = "kernels/row_ops.rs"]
pub(crate) mod row_ops;
pub mod runs;
pub mod sage_attention;
#[cfg(feature = "cuda")]
#[path = "kernels/sage_attn.rs"]
pub mod sage_kernels;
pub mod sequence_parallel;
pub mod source;
pub mod step_cache;
pub mod t5;
pub mod vae_tiling;
pub mod video;
pub mod wan;

/// What every model folder declares (the component configs it checks, the models it ships):
/// one line a folder.
pub const FOLDERS: &[source::ModelFolder] = &[
    wan::FOLDER,
    ltx::FOLDER,
    cogvideox::FOLDER,
    hunyuan_video::FOLDER,
    minimax_h3::FOLDER,
    latte::FOLDER,
    mochi::FOLDER,
    allegro::FOLDER,
    flux::FOLDER,
    t5::FOLDER,
    clip::FOLDER,
    crate::schedulers::FOLDER,
];

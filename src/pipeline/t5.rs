//! The T5 encoder stack (UMT5 for Wan, T5 v1.1 for LTX-Video and CogVideoX) as a placeable
//! component: its blocks stream in order (a T5 v1.1 block past the first takes block 0's
//! relative-position bias, see [`T5Block::forward_sharing_bias`]).

use super::placement::Blockwise;
use crate::models::t5::encoder::{T5Block, T5Config, T5EncoderModel};
use candle_nn::VarBuilder;

impl Blockwise for T5EncoderModel {
    type Config = T5Config;
    type Block = T5Block;
    fn whole(cfg: &Self::Config, vb: VarBuilder) -> candle_core::Result<Self> {
        Self::new(cfg, vb)
    }
    /// The token table stays in host memory: only the looked-up rows move.
    fn outer(cfg: &Self::Config, vb: VarBuilder, host_vb: VarBuilder) -> candle_core::Result<Self> {
        Self::new_without_blocks(cfg, vb, host_vb)
    }
    fn num_blocks(cfg: &Self::Config) -> usize {
        cfg.num_layers
    }
    fn block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> candle_core::Result<Self::Block> {
        Self::block(cfg, i, vb)
    }
}

//! CLIP's vision tower (transformers' `CLIPVisionModel` / `CLIPVisionModelWithProjection`, whose
//! projection no video pipeline uses): patch embedding, class token, learned positions,
//! `pre_layrnorm`, pre-LN encoder layers, `post_layernorm` on the class token.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Conv2dConfig, LayerNorm, VarBuilder};
use serde::Deserialize;

use super::encoder::{ClipActivation, ClipEncoderConfig, ClipEncoderLayer};

/// `image_encoder/config.json` (`clip_vision_model`); missing keys take transformers' defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct ClipVisionConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_channels: usize,
    /// Side of the square input image, in pixels.
    pub image_size: usize,
    /// Side of a square patch, in pixels.
    pub patch_size: usize,
    pub layer_norm_eps: f64,
    pub hidden_act: ClipActivation,
}

impl Default for ClipVisionConfig {
    fn default() -> Self {
        Self {
            hidden_size: 768,
            intermediate_size: 3072,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            num_channels: 3,
            image_size: 224,
            patch_size: 32,
            layer_norm_eps: 1e-5,
            hidden_act: ClipActivation::QuickGelu,
        }
    }
}

impl ClipVisionConfig {
    /// The encoder-layer sizes.
    pub fn encoder(&self) -> ClipEncoderConfig {
        ClipEncoderConfig {
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_attention_heads: self.num_attention_heads,
            layer_norm_eps: self.layer_norm_eps,
            hidden_act: self.hidden_act,
        }
    }

    /// Patches per image side.
    pub fn patches_per_side(&self) -> usize {
        self.image_size / self.patch_size.max(1)
    }

    /// Tokens per image: one class token plus the patches.
    pub fn num_positions(&self) -> usize {
        self.patches_per_side().pow(2) + 1
    }

    /// Rejects configurations the tower cannot run, naming the key.
    pub fn validate(&self) -> Result<()> {
        self.encoder().validate()?;
        if self.patch_size == 0 || self.image_size < self.patch_size {
            candle_core::bail!(
                "image encoder config: patch_size {} must be positive and at most image_size {}",
                self.patch_size,
                self.image_size
            )
        }
        if self.num_channels == 0 || self.num_hidden_layers == 0 {
            candle_core::bail!(
                "image encoder config: num_channels and num_hidden_layers must be positive"
            )
        }
        Ok(())
    }
}

/// The vision tower, or its first layers only: the Wan I2V pipelines use the penultimate
/// layer's hidden states, so [`ClipVisionModel::new_up_to_layer`] loads no more than that.
#[derive(Debug, Clone)]
pub struct ClipVisionModel {
    cfg: ClipVisionConfig,
    patch_embedding: candle_nn::Conv2d,
    class_embedding: Tensor,
    /// `[num_positions, hidden]`.
    position_embedding: Tensor,
    pre_layrnorm: LayerNorm,
    layers: Vec<ClipEncoderLayer>,
    /// Present only for the whole tower.
    post_layernorm: Option<LayerNorm>,
}

impl ClipVisionModel {
    /// The whole tower (every layer and `post_layernorm`); `vb` is the root of
    /// `image_encoder/model.safetensors` (the `vision_model.` prefix is found by itself).
    pub fn new(cfg: &ClipVisionConfig, vb: VarBuilder) -> Result<Self> {
        Self::build(cfg, cfg.num_hidden_layers, true, vb)
    }

    /// What the Wan image-to-video pipelines use: every layer but the last, so that
    /// [`Self::last_hidden_state`] is transformers' `hidden_states[-2]` (the `image_embeds`).
    pub fn new_penultimate(cfg: &ClipVisionConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        Self::new_up_to_layer(cfg, cfg.num_hidden_layers - 1, vb)
    }

    /// The embeddings and the first `num_layers` layers only, without `post_layernorm`: enough
    /// for `hidden_states[num_layers]` (the Wan pipelines' `hidden_states[-2]` is
    /// `num_layers = num_hidden_layers - 1`).
    pub fn new_up_to_layer(
        cfg: &ClipVisionConfig,
        num_layers: usize,
        vb: VarBuilder,
    ) -> Result<Self> {
        if num_layers > cfg.num_hidden_layers {
            candle_core::bail!(
                "image encoder: {num_layers} layers requested, num_hidden_layers is {}",
                cfg.num_hidden_layers
            )
        }
        Self::build(cfg, num_layers, false, vb)
    }

    fn build(
        cfg: &ClipVisionConfig,
        num_layers: usize,
        post: bool,
        vb: VarBuilder,
    ) -> Result<Self> {
        cfg.validate()?;
        let vb = if vb.contains_tensor("vision_model.embeddings.class_embedding") {
            vb.pp("vision_model")
        } else {
            vb
        };
        let d = cfg.hidden_size;
        let evb = vb.pp("embeddings");
        let conv_cfg = Conv2dConfig {
            stride: cfg.patch_size,
            ..Default::default()
        };
        let patch_embedding = candle_nn::conv2d_no_bias(
            cfg.num_channels,
            d,
            cfg.patch_size,
            conv_cfg,
            evb.pp("patch_embedding"),
        )?;
        let enc = cfg.encoder();
        let layers = (0..num_layers)
            .map(|i| ClipEncoderLayer::new(&enc, vb.pp(format!("encoder.layers.{i}"))))
            .collect::<Result<_>>()?;
        let post_layernorm = if post {
            Some(candle_nn::layer_norm(
                d,
                cfg.layer_norm_eps,
                vb.pp("post_layernorm"),
            )?)
        } else {
            None
        };
        Ok(Self {
            cfg: cfg.clone(),
            patch_embedding,
            class_embedding: evb.get(d, "class_embedding")?,
            position_embedding: evb.get((cfg.num_positions(), d), "position_embedding.weight")?,
            // Sic: transformers' name.
            pre_layrnorm: candle_nn::layer_norm(d, cfg.layer_norm_eps, vb.pp("pre_layrnorm"))?,
            layers,
            post_layernorm,
        })
    }

    /// The configuration the tower was built with.
    pub fn config(&self) -> &ClipVisionConfig {
        &self.cfg
    }

    /// Layers loaded.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// `pre_layrnorm(class token | patches + positions)` for `pixel_values` `[B, C, S, S]`:
    /// transformers' `hidden_states[0]`, `[B, num_positions, hidden]`.
    pub fn embeddings(&self, pixel_values: &Tensor) -> Result<Tensor> {
        let (b, c, h, w) = pixel_values.dims4()?;
        let cfg = &self.cfg;
        if c != cfg.num_channels || h != cfg.image_size || w != cfg.image_size {
            candle_core::bail!(
                "image encoder: pixel_values {:?} do not match [B, {}, {s}, {s}]",
                pixel_values.dims(),
                cfg.num_channels,
                s = cfg.image_size
            )
        }
        let dtype = self.class_embedding.dtype();
        let patches = self
            .patch_embedding
            .forward(&pixel_values.to_dtype(dtype)?)?
            .flatten_from(2)?
            .transpose(1, 2)?;
        let d = cfg.hidden_size;
        let class = self
            .class_embedding
            .reshape((1, 1, d))?
            .broadcast_as((b, 1, d))?;
        let x = Tensor::cat(&[class.contiguous()?, patches.contiguous()?], 1)?
            .broadcast_add(&self.position_embedding.unsqueeze(0)?)?;
        self.pre_layrnorm.forward(&x)
    }

    /// transformers' `hidden_states` tuple for the loaded layers: `[embeddings, layer 1 output,
    /// ..., layer n output]`, each `[B, num_positions, hidden]`.
    pub fn hidden_states(&self, pixel_values: &Tensor) -> Result<Vec<Tensor>> {
        let mut states = vec![self.embeddings(pixel_values)?];
        for layer in &self.layers {
            let next = layer.forward(states.last().expect("embeddings"), false)?;
            states.push(next);
        }
        Ok(states)
    }

    /// The output of the last loaded layer (`hidden_states[num_layers]`), keeping no other.
    pub fn last_hidden_state(&self, pixel_values: &Tensor) -> Result<Tensor> {
        let mut x = self.embeddings(pixel_values)?;
        for layer in &self.layers {
            x = layer.forward(&x, false)?;
        }
        Ok(x)
    }

    /// `post_layernorm` of the class token of `last_hidden_state` (transformers'
    /// `pooler_output`); needs the whole tower.
    pub fn pooled_output(&self, last_hidden_state: &Tensor) -> Result<Tensor> {
        let Some(norm) = &self.post_layernorm else {
            candle_core::bail!("image encoder: built without post_layernorm (partial tower)")
        };
        norm.forward(&last_hidden_state.narrow(1, 0, 1)?.squeeze(1)?)
    }

    /// Runs in this dtype.
    pub fn dtype(&self) -> DType {
        self.class_embedding.dtype()
    }
}

crate::placed_whole!(
    ClipVisionModel,
    ClipVisionConfig,
    ClipVisionModel::new_penultimate
);

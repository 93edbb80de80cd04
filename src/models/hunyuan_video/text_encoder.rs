//! The Llama text encoder of HunyuanVideo (transformers' `LlamaModel`) and the way
//! `HunyuanVideoPipeline._get_llama_prompt_embeds` uses it.
//!
//! The pipeline formats the prompt into a chat template, tokenizes it (`<|begin_of_text|>`
//! prepended, right-padded to `crop_start + max_sequence_length`), runs the model with the
//! padding mask (causal + padded keys masked) and takes `hidden_states[-3]`: the output of
//! layer `num_hidden_layers - 2`, before the final norm. The last two layers and the final norm
//! never run, so they are not loaded. The first `crop_start` positions (the template before the
//! prompt) are dropped from the embeddings and the mask; padded rows are kept as computed.
//!
//! The model is a list of decoder layers an engine can stream: [`LlamaTextEncoder::embed`],
//! [`LlamaTextEncoder::prepare`], then [`LlamaDecoderLayer::forward`] for each of
//! [`LlamaTextEncoder::blocks`] (built one at a time with [`LlamaDecoderLayer::new`] after
//! [`LlamaTextEncoder::new_without_blocks`]).
//!
//! Dtypes: weights and activations in the `VarBuilder` dtype; RMSNorm statistics and the
//! attention softmax in f32; RoPE tables computed in f32 and cast to the model dtype, as
//! transformers does.

use crate::models::blocks::Blockwise;
use anyhow::{anyhow, bail as anyhow_bail, Context};
use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{Embedding, Linear, VarBuilder};
use serde::Deserialize;
use std::path::Path;
use tokenizers::{PostProcessor, Tokenizer, TruncationDirection};

/// Layers after the one whose output the pipeline takes (`num_hidden_layers_to_skip=2`).
pub const LAYERS_SKIPPED: usize = 2;

/// The pipeline's `DEFAULT_PROMPT_TEMPLATE["crop_start"]`: the template's tokens before the
/// prompt as the original (verbatim) Llama-3 tokenizer counts them. diffusers crops this many
/// whatever tokenizer is loaded; [`LlamaPromptTokenizer::crop_start`] counts them with the
/// loaded one (219 for the tiny fixture's tokenizer).
pub const DEFAULT_CROP_START: usize = 95;

/// The pipeline's `DEFAULT_PROMPT_TEMPLATE["template"]`; `{}` is replaced by the prompt.
pub const DEFAULT_PROMPT_TEMPLATE: &str = "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video by detailing the following aspects: 1. The main content and theme of the video.2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects.3. Actions, events, behaviors temporal relationships, physical movement changes of the objects.4. background environment, light, style and atmosphere.5. camera angles, movements, and transitions used in the video:<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>";

/// transformers 5.x `rope_parameters` (or 4.x `rope_scaling`, whose older files say `type`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RopeParameters {
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default, alias = "type")]
    pub rope_type: Option<String>,
}

fn default_vocab() -> usize {
    32000
}
fn default_hidden() -> usize {
    4096
}
fn default_intermediate() -> usize {
    11008
}
fn default_layers() -> usize {
    32
}
fn default_heads() -> usize {
    32
}
fn default_eps() -> f64 {
    1e-6
}
fn default_act() -> String {
    "silu".into()
}

/// `text_encoder/config.json` (transformers' `LlamaConfig`); missing keys take transformers'
/// defaults, unknown keys are ignored.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct LlamaConfig {
    #[serde(default = "default_vocab")]
    pub vocab_size: usize,
    #[serde(default = "default_hidden")]
    pub hidden_size: usize,
    #[serde(default = "default_intermediate")]
    pub intermediate_size: usize,
    #[serde(default = "default_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "default_heads")]
    pub num_attention_heads: usize,
    /// `null`: as many as the attention heads.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// `null`: hidden_size / num_attention_heads.
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// Written by transformers 4.x.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// Written by transformers 5.x (takes precedence).
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    /// transformers 4.x RoPE scaling (only absent or `default` is supported).
    #[serde(default)]
    pub rope_scaling: Option<RopeParameters>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default = "default_act")]
    pub hidden_act: String,
}

impl LlamaConfig {
    /// Reads `text_encoder/config.json`.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// RoPE base (`rope_parameters.rope_theta`, else `rope_theta`, else 10000).
    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|p| p.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(10000.0)
    }

    /// Decoder layers that run: those before `hidden_states[-3]`.
    pub fn layers_used(&self) -> usize {
        self.num_hidden_layers.saturating_sub(LAYERS_SKIPPED)
    }

    /// Rejects configurations this encoder cannot run, naming the key.
    pub fn validate(&self) -> Result<()> {
        crate::models::config_checks::one_of(
            "text_encoder config",
            ("hidden_act", &self.hidden_act),
            &["silu"],
        )?;
        for (key, params) in [
            ("rope_parameters", &self.rope_parameters),
            ("rope_scaling", &self.rope_scaling),
        ] {
            if let Some(kind) = params.as_ref().and_then(|p| p.rope_type.as_deref()) {
                if kind != "default" {
                    candle_core::bail!(
                        "text_encoder config: {key}.rope_type {kind:?} is not supported"
                    );
                }
            }
        }
        if self.num_hidden_layers < LAYERS_SKIPPED {
            candle_core::bail!(
                "text_encoder config: num_hidden_layers {} is below the {LAYERS_SKIPPED} layers the pipeline skips",
                self.num_hidden_layers
            );
        }
        if self.hidden_size == 0 || self.intermediate_size == 0 || self.vocab_size == 0 {
            candle_core::bail!(
                "text_encoder config: hidden_size, intermediate_size and vocab_size must be positive"
            );
        }
        let kv = self.kv_heads();
        if self.num_attention_heads == 0 || kv == 0 || !self.num_attention_heads.is_multiple_of(kv)
        {
            candle_core::bail!(
                "text_encoder config: num_key_value_heads {kv} must divide num_attention_heads {}",
                self.num_attention_heads
            );
        }
        let hd = self.head_dim();
        if hd == 0 || !hd.is_multiple_of(2) {
            candle_core::bail!("text_encoder config: head_dim {hd} must be positive and even");
        }
        let theta = self.rope_theta();
        if !(theta.is_finite() && theta > 0.0) {
            candle_core::bail!("text_encoder config: rope_theta {theta} must be positive");
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            candle_core::bail!("text_encoder config: rms_norm_eps must be a non-negative number");
        }
        Ok(())
    }
}

/// Per-call tensors shared by every layer: RoPE tables and the additive attention mask.
#[derive(Debug, Clone)]
pub struct LlamaInputs {
    /// `[seq, head_dim / 2]` (model dtype).
    cos: Tensor,
    sin: Tensor,
    /// `[B, 1, seq, seq]` f32: 0 where query i may see key j (j <= i and j real), else f32::MIN.
    mask: Tensor,
}

#[derive(Debug, Clone)]
struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    fn new(cfg: &LlamaConfig, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get(cfg.hidden_size, "weight")?,
            eps: cfg.rms_norm_eps as f32,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        candle_nn::ops::rms_norm(x, &self.weight, self.eps)
    }
}

fn linear(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    if bias {
        candle_nn::linear(in_dim, out_dim, vb)
    } else {
        candle_nn::linear_no_bias(in_dim, out_dim, vb)
    }
}

/// One `LlamaDecoderLayer`: pre-norm GQA self-attention with RoPE, pre-norm SwiGLU MLP.
#[derive(Debug, Clone)]
pub struct LlamaDecoderLayer {
    input_layernorm: RmsNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    post_attention_layernorm: RmsNorm,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl LlamaDecoderLayer {
    /// Loads one layer; `vb` points at `layers.{i}`.
    pub fn new(cfg: &LlamaConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        let (heads, kv) = (cfg.num_attention_heads, cfg.kv_heads());
        let attn = vb.pp("self_attn");
        let mlp = vb.pp("mlp");
        let (ab, mb) = (cfg.attention_bias, cfg.mlp_bias);
        Ok(Self {
            input_layernorm: RmsNorm::new(cfg, vb.pp("input_layernorm"))?,
            q_proj: linear(h, heads * hd, ab, attn.pp("q_proj"))?,
            k_proj: linear(h, kv * hd, ab, attn.pp("k_proj"))?,
            v_proj: linear(h, kv * hd, ab, attn.pp("v_proj"))?,
            o_proj: linear(heads * hd, h, ab, attn.pp("o_proj"))?,
            post_attention_layernorm: RmsNorm::new(cfg, vb.pp("post_attention_layernorm"))?,
            gate_proj: linear(h, cfg.intermediate_size, mb, mlp.pp("gate_proj"))?,
            up_proj: linear(h, cfg.intermediate_size, mb, mlp.pp("up_proj"))?,
            down_proj: linear(cfg.intermediate_size, h, mb, mlp.pp("down_proj"))?,
            heads,
            kv_heads: kv,
            head_dim: hd,
        })
    }

    /// `x` `[B, seq, hidden]` -> the layer's output, same shape and dtype.
    pub fn forward(&self, x: &Tensor, inputs: &LlamaInputs) -> Result<Tensor> {
        let (b, seq, _) = x.dims3()?;
        let h = self.input_layernorm.forward(x)?;
        let heads = |t: Tensor, n: usize| -> Result<Tensor> {
            t.reshape((b, seq, n, self.head_dim))?
                .transpose(1, 2)?
                .contiguous()
        };
        let rope = |t: Tensor| candle_nn::rotary_emb::rope(&t, &inputs.cos, &inputs.sin);
        let q = rope(heads(self.q_proj.forward(&h)?, self.heads)?)?;
        let k = rope(heads(self.k_proj.forward(&h)?, self.kv_heads)?)?;
        let v = heads(self.v_proj.forward(&h)?, self.kv_heads)?;
        // Grouped-query attention: each kv head serves `heads / kv_heads` query heads.
        let group = self.heads / self.kv_heads;
        let repeat = |t: Tensor| -> Result<Tensor> {
            if group == 1 {
                return Ok(t);
            }
            t.unsqueeze(2)?
                .broadcast_as((b, self.kv_heads, group, seq, self.head_dim))?
                .reshape((b, self.heads, seq, self.head_dim))
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        let scores = (f32(&q)?.matmul(&f32(&k)?.t()?)? * scale)?.broadcast_add(&inputs.mask)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = probs
            .matmul(&f32(&v)?)?
            .to_dtype(x.dtype())?
            .transpose(1, 2)?
            .reshape((b, seq, self.heads * self.head_dim))?;
        let x = (x + self.o_proj.forward(&out)?)?;

        let h = self.post_attention_layernorm.forward(&x)?;
        let gate = candle_nn::ops::silu(&self.gate_proj.forward(&h)?)?;
        let mlp = self
            .down_proj
            .forward(&(gate * self.up_proj.forward(&h)?)?)?;
        x + mlp
    }
}

/// The layers of transformers' `LlamaModel` that HunyuanVideo runs (all but the last two),
/// without the final norm.
#[derive(Debug, Clone)]
pub struct LlamaTextEncoder {
    cfg: LlamaConfig,
    embed_tokens: Embedding,
    blocks: Vec<LlamaDecoderLayer>,
    dtype: DType,
}

impl LlamaTextEncoder {
    /// Loads the embeddings and the layers that run (`cfg.layers_used()`).
    pub fn new(cfg: &LlamaConfig, vb: VarBuilder) -> Result<Self> {
        let mut model = Self::new_without_blocks(cfg, vb.clone())?;
        model.blocks = crate::models::blocks::all_blocks::<Self>(cfg, &vb)?;
        Ok(model)
    }

    /// Loads the embeddings only; layer `i` is then built with
    /// `LlamaDecoderLayer::new(cfg, vb.pp(format!("layers.{i}")))` for `i < cfg.layers_used()`.
    pub fn new_without_blocks(cfg: &LlamaConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let embed_tokens =
            candle_nn::embedding(cfg.vocab_size, cfg.hidden_size, vb.pp("embed_tokens"))?;
        Ok(Self {
            cfg: cfg.clone(),
            embed_tokens,
            blocks: Vec::new(),
            dtype: vb.dtype(),
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The loaded layers, in order (empty after `new_without_blocks`).
    pub fn blocks(&self) -> &[LlamaDecoderLayer] {
        &self.blocks
    }

    /// Token embeddings `[B, seq, hidden]` of `input_ids` `[B, seq]` (`hidden_states[0]`).
    pub fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        let ids = input_ids.to_dtype(DType::U32)?;
        let max = ids.max_all()?.to_scalar::<u32>()? as usize;
        if max >= self.cfg.vocab_size {
            candle_core::bail!(
                "token id {max} is outside the text encoder's vocab_size {}",
                self.cfg.vocab_size
            );
        }
        self.embed_tokens.forward(&ids)
    }

    /// RoPE tables for positions `0..seq` and the causal + padding mask of `attention_mask`
    /// `[B, seq]` (1 real, 0 padding; any dtype).
    pub fn prepare(&self, attention_mask: &Tensor, device: &Device) -> Result<LlamaInputs> {
        let (b, seq) = attention_mask.dims2()?;
        let hd = self.cfg.head_dim();
        let theta = self.cfg.rope_theta() as f32;
        // transformers: inv_freq = 1 / theta^(arange(0, hd, 2) / hd) and angles in f32.
        let inv_freq: Vec<f32> = (0..hd / 2)
            .map(|j| 1.0 / theta.powf((2 * j) as f32 / hd as f32))
            .collect();
        let mut cos = Vec::with_capacity(seq * hd / 2);
        let mut sin = Vec::with_capacity(seq * hd / 2);
        for p in 0..seq {
            for &f in &inv_freq {
                let angle = f * p as f32;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let table = |v: Vec<f32>| -> Result<Tensor> {
            Tensor::from_vec(v, (seq, hd / 2), device)?.to_dtype(self.dtype)
        };
        let rows = attention_mask
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .to_vec2::<f32>()?;
        let mut mask = Vec::with_capacity(b * seq * seq);
        for row in &rows {
            for i in 0..seq {
                mask.extend((0..seq).map(|j| {
                    if j <= i && row[j] != 0.0 {
                        0.0
                    } else {
                        f32::MIN
                    }
                }));
            }
        }
        Ok(LlamaInputs {
            cos: table(cos)?,
            sin: table(sin)?,
            mask: Tensor::from_vec(mask, (b, 1, seq, seq), device)?,
        })
    }

    /// `hidden_states[-3]` of `input_ids` `[B, seq]` under `attention_mask` `[B, seq]`: the
    /// output of every loaded layer. Needs a model built with `new`.
    pub fn forward(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        if self.blocks.len() != self.cfg.layers_used() {
            candle_core::bail!(
                "text encoder holds {} of {} layers; run them through blocks() instead",
                self.blocks.len(),
                self.cfg.layers_used()
            );
        }
        let inputs = self.prepare(attention_mask, input_ids.device())?;
        let mut h = self.embed(input_ids)?;
        for block in &self.blocks {
            h = block.forward(&h, &inputs)?;
        }
        Ok(h)
    }
}

/// The pipeline's crop: drops the first `crop_start` positions of `hidden` `[B, seq, hidden]`
/// and `attention_mask` `[B, seq]` (the template before the prompt).
pub fn crop_prompt(
    hidden: &Tensor,
    attention_mask: &Tensor,
    crop_start: usize,
) -> Result<(Tensor, Tensor)> {
    let seq = hidden.dim(1)?;
    if crop_start >= seq {
        candle_core::bail!("crop_start {crop_start} leaves nothing of {seq} tokens");
    }
    Ok((
        hidden.narrow(1, crop_start, seq - crop_start)?,
        attention_mask.narrow(D::Minus1, crop_start, seq - crop_start)?,
    ))
}

/// How the checkpoint's `tokenizer.json` is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlamaTokenizerLoad {
    /// transformers 5.x `LlamaTokenizer(Fast)`, what diffusers gets when `model_index.json` names
    /// `LlamaTokenizerFast` (the published checkpoint): the vocab, merges and added tokens are
    /// kept, the rest is rebuilt (no normalizer, Metaspace pre-tokenizer, byte fallback, no unk
    /// token; the post-processor as transformers keeps or rebuilds it). On a Llama-3 byte-level
    /// file this tokenizes differently from the file itself (see the fixture README).
    LlamaTokenizerFast,
    /// `AutoTokenizer` / `PreTrainedTokenizerFast`: the file as written.
    Verbatim,
}

impl LlamaTokenizerLoad {
    /// The behaviour of the tokenizer class `model_index.json` names for `tokenizer`.
    pub fn for_class(class: &str) -> Self {
        match class {
            "LlamaTokenizerFast" | "LlamaTokenizer" => Self::LlamaTokenizerFast,
            _ => Self::Verbatim,
        }
    }
}

/// The Llama tokenizer of the checkpoint, used as `_get_llama_prompt_embeds` calls it:
/// `max_length`, right padding with the pad token, truncation.
pub struct LlamaPromptTokenizer {
    tokenizer: Tokenizer,
    pad_id: u32,
}

/// Rewrites a `tokenizer.json` the way transformers 5.x `LlamaTokenizer.__init__` rebuilds it
/// from its vocab and merges. `config` is `tokenizer_config.json` (may be `null`).
fn rebuild_as_llama_tokenizer_fast(
    mut json: serde_json::Value,
    config: &serde_json::Value,
) -> anyhow::Result<serde_json::Value> {
    use serde_json::json;
    // Tokens are strings or (older files) AddedToken objects with a "content".
    let cfg_str = |key: &str| {
        let v = config.get(key)?;
        v.as_str()
            .or_else(|| v.get("content")?.as_str())
            .map(str::to_owned)
    };
    let cfg_bool = |key: &str| config.get(key).and_then(|v| v.as_bool());
    let add_prefix_space = cfg_bool("add_prefix_space").unwrap_or(true);
    let legacy = cfg_bool("legacy").unwrap_or(false);
    let prepend_scheme = match (add_prefix_space, legacy) {
        (false, _) => "never",
        (true, true) => "always",
        (true, false) => "first",
    };
    let model = json
        .get_mut("model")
        .and_then(|m| m.as_object_mut())
        .context("tokenizer.json has no model")?;
    if model.get("type").and_then(|t| t.as_str()) != Some("BPE") {
        anyhow_bail!("tokenizer.json: a Llama tokenizer needs a BPE model");
    }
    // `BPE(vocab, merges, fuse_unk=True, byte_fallback=True, dropout=None)`: no unk token.
    model.insert("dropout".into(), json!(null));
    model.insert("unk_token".into(), json!(null));
    model.insert("continuing_subword_prefix".into(), json!(null));
    model.insert("end_of_word_suffix".into(), json!(null));
    model.insert("fuse_unk".into(), json!(true));
    model.insert("byte_fallback".into(), json!(true));
    model.insert("ignore_merges".into(), json!(false));
    json["normalizer"] = json!(null);
    json["pre_tokenizer"] = json!({
        "type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": prepend_scheme, "split": false
    });
    // The file's post-processor is kept unless tokenizer_config.json sets add_bos_token or
    // add_eos_token (or the file has none): then `update_post_processor` rebuilds it.
    let explicit = config.get("add_bos_token").is_some() || config.get("add_eos_token").is_some();
    if !explicit && !json["post_processor"].is_null() {
        return Ok(json);
    }
    let add_bos = cfg_bool("add_bos_token").unwrap_or(false);
    let add_eos = cfg_bool("add_eos_token").unwrap_or(false);
    let bos = cfg_str("bos_token").unwrap_or_else(|| "<s>".into());
    let eos = cfg_str("eos_token").unwrap_or_else(|| "</s>".into());
    let id_of = |token: &str| -> Option<u64> {
        let added =
            json.get("added_tokens")?.as_array()?.iter().find_map(|t| {
                (t.get("content")?.as_str()? == token).then(|| t.get("id")?.as_u64())?
            });
        added.or_else(|| json.get("model")?.get("vocab")?.get(token)?.as_u64())
    };
    let mut special = serde_json::Map::new();
    let mut piece =
        |on: bool, token: &String, type_id: u32| -> anyhow::Result<Vec<serde_json::Value>> {
            if !on {
                return Ok(Vec::new());
            }
            let id = id_of(token).with_context(|| format!("tokenizer has no {token:?} token"))?;
            special.insert(
                token.clone(),
                json!({"id": token, "ids": [id], "tokens": [token]}),
            );
            Ok(vec![
                json!({"SpecialToken": {"id": token, "type_id": type_id}}),
            ])
        };
    let sequence = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
    let mut single = piece(add_bos, &bos, 0)?;
    single.push(sequence("A", 0));
    single.extend(piece(add_eos, &eos, 0)?);
    let mut pair = single.clone();
    pair.extend(piece(add_bos, &bos, 1)?);
    pair.push(sequence("B", 1));
    pair.extend(piece(add_eos, &eos, 1)?);
    json["post_processor"] = json!({
        "type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special
    });
    Ok(json)
}

impl LlamaPromptTokenizer {
    /// Loads `dir/tokenizer.json` (and `dir/tokenizer_config.json` when present) as `load` says.
    pub fn from_dir(dir: &Path, load: LlamaTokenizerLoad) -> anyhow::Result<Self> {
        let path = dir.join("tokenizer.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let config = std::fs::read_to_string(dir.join("tokenizer_config.json")).ok();
        Self::from_json(&text, config.as_deref(), load)
            .with_context(|| format!("loading {}", path.display()))
    }

    /// Loads a `tokenizer.json`'s text (with its `tokenizer_config.json`'s when there is one)
    /// as `load` says.
    pub fn from_json(
        text: &str,
        config: Option<&str>,
        load: LlamaTokenizerLoad,
    ) -> anyhow::Result<Self> {
        let config: serde_json::Value = match config {
            Some(c) => serde_json::from_str(c).context("parsing tokenizer_config.json")?,
            None => serde_json::Value::Null,
        };
        let json: serde_json::Value =
            serde_json::from_str(text).context("parsing tokenizer.json")?;
        let json = match load {
            LlamaTokenizerLoad::LlamaTokenizerFast => {
                rebuild_as_llama_tokenizer_fast(json, &config)?
            }
            LlamaTokenizerLoad::Verbatim => json,
        };
        let mut tokenizer: Tokenizer = serde_json::to_string(&json)?
            .parse()
            .map_err(|e| anyhow!("building the tokenizer: {e}"))?;
        tokenizer
            .with_truncation(None)
            .map_err(|e| anyhow!("{e}"))?;
        tokenizer.with_padding(None);
        let pad = config
            .get("pad_token")
            .and_then(|v| v.as_str().or_else(|| v.get("content")?.as_str()))
            .unwrap_or("<pad>");
        let pad_id = tokenizer
            .token_to_id(pad)
            .with_context(|| format!("the tokenizer has no pad token {pad:?}"))?;
        Ok(Self { tokenizer, pad_id })
    }

    /// Ids of `text` with the special tokens, unpadded and untruncated.
    pub fn ids(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let encoding = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| anyhow!("tokenizing {text:?}: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Tokens of the template before the prompt (BOS included): the pipeline's `crop_start`
    /// (95 for the published tokenizer loaded verbatim, see [`DEFAULT_CROP_START`]).
    pub fn crop_start(&self, template: &str) -> anyhow::Result<usize> {
        let Some((prefix, _)) = template.split_once("{}") else {
            anyhow_bail!("the prompt template has no {{}} placeholder");
        };
        Ok(self.ids(prefix)?.len())
    }

    /// `template.format(prompt)` tokenized to exactly `max_len` ids (truncated, then right-padded)
    /// and the number of real tokens.
    pub fn encode(
        &self,
        template: &str,
        prompt: &str,
        max_len: usize,
    ) -> anyhow::Result<(Vec<u32>, usize)> {
        let text = template.replacen("{}", prompt, 1);
        let added = self
            .tokenizer
            .get_post_processor()
            .map_or(0, |p| p.added_tokens(false));
        if max_len <= added {
            anyhow_bail!("max length {max_len} leaves no room for the prompt");
        }
        let mut encoding = self
            .tokenizer
            .encode(text.as_str(), false)
            .map_err(|e| anyhow!("tokenizing {text:?}: {e}"))?;
        encoding.truncate(max_len - added, 0, TruncationDirection::Right);
        let encoding = self
            .tokenizer
            .post_process(encoding, None, true)
            .map_err(|e| anyhow!("tokenizing {text:?}: {e}"))?;
        let mut ids = encoding.get_ids().to_vec();
        let len = ids.len();
        ids.resize(max_len, self.pad_id);
        Ok((ids, len))
    }

    /// Ids `[B, crop_start + max_sequence_length]` (i64) and the mask (i64, 1 real, 0 padding)
    /// of a batch of prompts, as `_get_llama_prompt_embeds` builds them.
    pub fn batch(
        &self,
        template: &str,
        prompts: &[&str],
        crop_start: usize,
        max_sequence_length: usize,
        device: &Device,
    ) -> anyhow::Result<(Tensor, Tensor)> {
        let max_len = crop_start + max_sequence_length;
        let mut ids = Vec::with_capacity(prompts.len() * max_len);
        let mut mask = Vec::with_capacity(prompts.len() * max_len);
        for prompt in prompts {
            let (row, len) = self.encode(template, prompt, max_len)?;
            ids.extend(row.into_iter().map(i64::from));
            mask.extend((0..max_len).map(|i| i64::from(i < len)));
        }
        let shape = (prompts.len(), max_len);
        Ok((
            Tensor::from_vec(ids, shape, device)?,
            Tensor::from_vec(mask, shape, device)?,
        ))
    }
}

/// Placed by the block protocol: its decoder layers stream one by one.
impl Blockwise for LlamaTextEncoder {
    type Config = LlamaConfig;
    type Block = LlamaDecoderLayer;
    fn whole(cfg: &Self::Config, vb: VarBuilder) -> Result<Self> {
        Self::new(cfg, vb)
    }
    fn outer(cfg: &Self::Config, vb: VarBuilder, _: VarBuilder) -> Result<Self> {
        Self::new_without_blocks(cfg, vb)
    }
    /// Only the layers up to `hidden_states[-3]` run (and load).
    fn num_blocks(cfg: &Self::Config) -> usize {
        cfg.layers_used()
    }
    fn block(cfg: &Self::Config, i: usize, vb: VarBuilder) -> Result<Self::Block> {
        LlamaDecoderLayer::new(cfg, vb.pp(format!("layers.{i}")))
    }
}

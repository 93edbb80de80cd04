//! The T5 SentencePiece tokenizer as the diffusers pipelines call it.

use crate::models::source::{FileRef, ModelSource};
use anyhow::{anyhow, bail, Context, Result};
use std::path::Path;
use tokenizers::{PostProcessor, Tokenizer, TruncationDirection};

/// The T5 tokenizer of the checkpoint (`tokenizer/tokenizer.json`), used the way the T5
/// pipelines (Wan, LTX-Video, CogVideoX) call it: `padding="max_length"`, `truncation=True`,
/// `</s>` appended.
pub struct PromptTokenizer {
    tokenizer: Tokenizer,
    pad_id: u32,
}

impl PromptTokenizer {
    /// Loads `tokenizer.json`; the file's own truncation/padding settings are dropped because
    /// every call sets its own length.
    pub fn from_file(path: &Path) -> Result<Self> {
        let tokenizer = Tokenizer::from_file(path)
            .map_err(|e| anyhow!("loading tokenizer {}: {e}", path.display()))?;
        Self::with_tokenizer(tokenizer).with_context(|| format!("tokenizer {}", path.display()))
    }

    /// Parses the text of a `tokenizer.json` (for tokenizers shipped inside the binary).
    pub fn from_json(json: &str) -> Result<Self> {
        let tokenizer: Tokenizer = json
            .parse()
            .map_err(|e| anyhow!("parsing tokenizer.json: {e}"))?;
        Self::with_tokenizer(tokenizer)
    }

    /// The `tokenizer.json` at `rel` in `source` (the file, or the stand-in a synthetic model
    /// ships).
    pub fn from_source(source: &ModelSource, rel: &str) -> Result<Self> {
        Self::from_ref(source.require(rel)?)
    }

    /// `tokenizer/tokenizer.json` of `family`'s model `source`, whose checkpoints may ship only
    /// `spiece.model`: where it is missing, the error says how to write it.
    pub fn from_source_or_spiece(source: &ModelSource, family: &str) -> Result<Self> {
        let file = source.require("tokenizer/tokenizer.json").with_context(|| format!(
            "{family} reads tokenizer/tokenizer.json; where a checkpoint ships only spiece.model, write it once with transformers: T5TokenizerFast.from_pretrained(folder, subfolder=\"tokenizer\").save_pretrained(folder + \"/tokenizer\")"
        ))?;
        Self::from_ref(file)
    }

    fn from_ref(file: FileRef) -> Result<Self> {
        match file {
            FileRef::Path(p) => Self::from_file(&p),
            FileRef::Embedded(text) => Self::from_json(text),
        }
    }

    fn with_tokenizer(mut tokenizer: Tokenizer) -> Result<Self> {
        tokenizer
            .with_truncation(None)
            .map_err(|e| anyhow!("{e}"))?;
        tokenizer.with_padding(None);
        let pad_id = tokenizer
            .token_to_id("<pad>")
            .context("the tokenizer has no <pad> token")?;
        Ok(Self { tokenizer, pad_id })
    }

    /// Token ids of a prompt (cleaned first where the pipeline cleans), right-padded with `<pad>` to `max_len`, and the
    /// number of real tokens (including the final `</s>`, which truncation keeps last).
    pub fn encode(&self, cleaned: &str, max_len: usize) -> Result<(Vec<u32>, usize)> {
        let added = self
            .tokenizer
            .get_post_processor()
            .map_or(0, |p| p.added_tokens(false));
        if max_len <= added {
            bail!("max_sequence_length {max_len} leaves no room for the prompt ({added} special tokens)");
        }
        let mut encoding = self
            .tokenizer
            .encode(cleaned, false)
            .map_err(|e| anyhow!("tokenizing {cleaned:?}: {e}"))?;
        encoding.truncate(max_len - added, 0, TruncationDirection::Right);
        let encoding = self
            .tokenizer
            .post_process(encoding, None, true)
            .map_err(|e| anyhow!("tokenizing {cleaned:?}: {e}"))?;
        let mut ids = encoding.get_ids().to_vec();
        let seq_len = ids.len();
        if seq_len > max_len {
            bail!("tokenizer produced {seq_len} tokens for max_sequence_length {max_len}");
        }
        ids.resize(max_len, self.pad_id);
        Ok((ids, seq_len))
    }
}

/// The PixArt-style pipelines' `_text_preprocessing` (Latte, Allegro) without beautifulsoup4, or
/// with `clean_caption=False`: Python's `text.lower().strip()`.
pub fn clean_caption(text: &str) -> String {
    // str.strip() drops what str.isspace() calls whitespace: Unicode White_Space plus the
    // information separators U+001C..U+001F.
    let is_space = |c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c);
    text.to_lowercase().trim_matches(is_space).to_string()
}

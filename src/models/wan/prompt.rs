//! The text side of `WanPipeline` before the encoder: prompt cleaning and tokenization.
//!
//! diffusers cleans every prompt with `prompt_clean` (ftfy's `fix_text` when ftfy is installed,
//! `html.unescape` twice, whitespace collapsed) and tokenizes it with the T5 tokenizer padded to
//! `max_sequence_length`. The cleaning changes token ids and therefore the video, so it is
//! reproduced here: ftfy's fixes for Latin-1 / Windows-1252 mojibake, C1 controls, ligatures,
//! full-width characters, curly quotes, line breaks, terminal escapes and control characters,
//! NFC, and a port of Python's `html.unescape` (legacy entities without `;` included).
//! Not reproduced: ftfy's mojibake repair through other single-byte codecs (Cyrillic, Greek,
//! Mac Roman ...), its `badness` heuristic (Latin-1 / Windows-1252 text whose bytes form valid
//! UTF-8 is always repaired) and its NBSP-restoring and lossy-sequence variants.

pub use crate::models::t5::tokenizer::PromptTokenizer;
use unicode_normalization::UnicodeNormalization;

/// ftfy repeats its fixes until the text stops changing; this bounds that loop.
const MAX_FIX_ROUNDS: usize = 32;

/// WanPipeline's `prompt_clean`: ftfy fixes, `html.unescape` twice, strip, every whitespace run
/// to one space, strip.
pub fn clean_prompt(raw: &str) -> String {
    let unescaped = html_unescape(&html_unescape(&fix_text(raw)));
    let mut out = String::with_capacity(unescaped.len());
    let mut pending_space = false;
    for c in unescaped.chars() {
        if is_py_space(c) {
            pending_space = !out.is_empty();
        } else {
            if pending_space {
                out.push(' ');
                pending_space = false;
            }
            out.push(c);
        }
    }
    out
}

/// Python's `str.isspace` (what `\s` and `strip()` match): Unicode White_Space plus the
/// information separators U+001C..U+001F.
fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// ftfy's `fix_text` with its default configuration: line by line; HTML entities are only
/// unescaped until a line containing `<` is seen.
fn fix_text(text: &str) -> String {
    let mut unescape = true;
    let mut out = String::with_capacity(text.len());
    for segment in text.split_inclusive('\n') {
        if unescape && segment.contains('<') {
            unescape = false;
        }
        out.push_str(&fix_segment(segment, unescape));
    }
    out
}

/// ftfy's `fix_and_explain`: all fixes in ftfy's order, repeated until nothing changes.
fn fix_segment(segment: &str, unescape: bool) -> String {
    let mut text = segment.to_string();
    for _ in 0..MAX_FIX_ROUNDS {
        let orig = text.clone();
        if unescape {
            text = ftfy_unescape_html(&text);
        }
        text = fix_encoding(&text);
        text = text.chars().map(fix_c1_control).collect();
        text = translate(&text, |c, out| match latin_ligature(c) {
            Some(s) => out.push_str(s),
            None => out.push(c),
        });
        text = translate(&text, fix_character_width);
        text = text.chars().map(uncurl_quote).collect();
        text = fix_line_breaks(&text);
        text = remove_terminal_escapes(&text);
        text.retain(|c| !is_removed_control_char(c));
        text = text.nfc().collect();
        if text == orig {
            break;
        }
    }
    text
}

/// Windows-1252 bytes 0x80..=0x9F; the five undefined bytes decode to the C1 control of the
/// same value (Python's "sloppy-windows-1252", as ftfy uses it).
const CP1252_HIGH: [char; 32] = [
    '\u{20AC}', '\u{81}', '\u{201A}', '\u{192}', '\u{201E}', '\u{2026}', '\u{2020}', '\u{2021}',
    '\u{2C6}', '\u{2030}', '\u{160}', '\u{2039}', '\u{152}', '\u{8D}', '\u{17D}', '\u{8F}',
    '\u{90}', '\u{2018}', '\u{2019}', '\u{201C}', '\u{201D}', '\u{2022}', '\u{2013}', '\u{2014}',
    '\u{2DC}', '\u{2122}', '\u{161}', '\u{203A}', '\u{153}', '\u{9D}', '\u{17E}', '\u{178}',
];

/// The byte a character has in Latin-1, or else in sloppy Windows-1252.
fn single_byte(c: char) -> Option<u8> {
    match u8::try_from(u32::from(c)) {
        Ok(b) => Some(b),
        Err(_) => CP1252_HIGH
            .iter()
            .position(|&x| x == c)
            .and_then(|i| u8::try_from(0x80 + i).ok()),
    }
}

/// Re-reads text that was UTF-8 decoded as Latin-1 / Windows-1252; `None` when the text is not
/// single-byte encodable or its bytes are not valid UTF-8.
fn redecode_utf8(text: &str) -> Option<String> {
    let bytes: Option<Vec<u8>> = text.chars().map(single_byte).collect();
    String::from_utf8(bytes?).ok()
}

/// ftfy's `fix_encoding`: one repair step at a time until nothing changes.
fn fix_encoding(text: &str) -> String {
    let mut text = text.to_string();
    for _ in 0..MAX_FIX_ROUNDS {
        match fix_encoding_step(&text) {
            Some(fixed) if fixed != text => text = fixed,
            _ => break,
        }
    }
    text
}

/// One mojibake repair: the whole text re-decoded, else each embedded run of UTF-8-looking
/// characters (ftfy's `decode_inconsistent_utf8`).
fn fix_encoding_step(text: &str) -> Option<String> {
    if text.is_ascii() {
        return None;
    }
    redecode_utf8(text).or_else(|| decode_inconsistent_utf8(text))
}

/// Byte class of a character under Latin-1 / Windows-1252: a UTF-8 continuation byte, or a lead
/// byte announcing that many continuation bytes.
#[derive(PartialEq)]
enum Utf8Role {
    Continuation,
    Lead(usize),
    Other,
}

fn utf8_role(c: char) -> Utf8Role {
    match single_byte(c) {
        Some(0x80..=0xBF) => Utf8Role::Continuation,
        Some(0xC2..=0xDF) => Utf8Role::Lead(1),
        Some(0xE0..=0xEF) => Utf8Role::Lead(2),
        Some(0xF0..=0xF4) => Utf8Role::Lead(3),
        _ => Utf8Role::Other,
    }
}

/// ftfy's `UTF8_DETECTOR_RE` substitution: maximal runs of (lead, continuations) not preceded
/// by a continuation character, each shorter than the text, re-decoded where that is valid.
fn decode_inconsistent_utf8(text: &str) -> Option<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut changed = false;
    let mut i = 0;
    while i < chars.len() {
        let preceded_by_continuation = i > 0 && utf8_role(chars[i - 1]) == Utf8Role::Continuation;
        let mut end = i;
        if !preceded_by_continuation {
            while let Utf8Role::Lead(n) = chars.get(end).map_or(Utf8Role::Other, |&c| utf8_role(c))
            {
                let seq_end = end + 1 + n;
                let complete = seq_end <= chars.len()
                    && chars[end + 1..seq_end]
                        .iter()
                        .all(|&c| utf8_role(c) == Utf8Role::Continuation);
                if !complete {
                    break;
                }
                end = seq_end;
            }
        }
        if end == i {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let run: String = chars[i..end].iter().collect();
        match redecode_utf8(&run).filter(|_| end - i < chars.len()) {
            Some(fixed) => {
                out.push_str(&fixed);
                changed = true;
            }
            None => out.push_str(&run),
        }
        i = end;
    }
    changed.then_some(out)
}

/// ftfy's `fix_c1_controls`: C1 controls are Windows-1252 characters decoded as Latin-1.
fn fix_c1_control(c: char) -> char {
    match u32::from(c) {
        n @ 0x80..=0x9F => CP1252_HIGH[(n - 0x80) as usize],
        _ => c,
    }
}

/// Rebuilds `text` with every character replaced by what `f` pushes for it.
fn translate(text: &str, f: impl Fn(char, &mut String)) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        f(c, &mut out);
    }
    out
}

/// ftfy's `fix_latin_ligatures` table.
fn latin_ligature(c: char) -> Option<&'static str> {
    Some(match c {
        'Ĳ' => "IJ",
        'ĳ' => "ij",
        'ŉ' => "ʼn",
        'Ǳ' => "DZ",
        'ǲ' => "Dz",
        'ǳ' => "dz",
        'Ǆ' => "DŽ",
        'ǅ' => "Dž",
        'ǆ' => "dž",
        'Ǉ' => "LJ",
        'ǈ' => "Lj",
        'ǉ' => "lj",
        'Ǌ' => "NJ",
        'ǋ' => "Nj",
        'ǌ' => "nj",
        'ﬀ' => "ff",
        'ﬁ' => "fi",
        'ﬂ' => "fl",
        'ﬃ' => "ffi",
        'ﬄ' => "ffl",
        'ﬅ' => "ſt",
        'ﬆ' => "st",
        _ => return None,
    })
}

/// ftfy's `fix_character_width`: U+3000 to a space, U+FF01..U+FFEF to their NFKC form.
fn fix_character_width(c: char, out: &mut String) {
    match c {
        '\u{3000}' => out.push(' '),
        '\u{FF01}'..='\u{FFEF}' => out.extend(std::iter::once(c).nfkc()),
        _ => out.push(c),
    }
}

/// ftfy's `uncurl_quotes`.
fn uncurl_quote(c: char) -> char {
    match c {
        '\u{2BC}' | '\u{2018}'..='\u{201B}' => '\'',
        '\u{201C}'..='\u{201F}' => '"',
        _ => c,
    }
}

/// ftfy's `fix_line_breaks`.
fn fix_line_breaks(text: &str) -> String {
    text.replace("\r\n", "\n")
        .replace(['\r', '\u{2028}', '\u{2029}', '\u{85}'], "\n")
}

/// ftfy's `remove_terminal_escapes`: ANSI sequences `ESC [ [0-9;]* [A-Za-z]`.
fn remove_terminal_escapes(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find("\u{1b}[") {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 2..];
        let params = after
            .bytes()
            .take_while(|b| b.is_ascii_digit() || *b == b';')
            .count();
        if after
            .as_bytes()
            .get(params)
            .is_some_and(u8::is_ascii_alphabetic)
        {
            rest = &after[params + 1..];
        } else {
            out.push('\u{1b}');
            rest = &rest[pos + 1..];
        }
    }
    out.push_str(rest);
    out
}

/// ftfy's `remove_control_chars` set.
fn is_removed_control_char(c: char) -> bool {
    matches!(
        u32::from(c),
        0x00..=0x08 | 0x0B | 0x0E..=0x1F | 0x7F | 0x206A..=0x206F | 0xFEFF | 0xFFF9..=0xFFFC
    )
}

/// The entities WHATWG (and Python's `html.entities.html5`) also accept without `;`.
const LEGACY_ENTITIES: [&str; 106] = [
    "AElig", "AMP", "Aacute", "Acirc", "Agrave", "Aring", "Atilde", "Auml", "COPY", "Ccedil",
    "ETH", "Eacute", "Ecirc", "Egrave", "Euml", "GT", "Iacute", "Icirc", "Igrave", "Iuml", "LT",
    "Ntilde", "Oacute", "Ocirc", "Ograve", "Oslash", "Otilde", "Ouml", "QUOT", "REG", "THORN",
    "Uacute", "Ucirc", "Ugrave", "Uuml", "Yacute", "aacute", "acirc", "acute", "aelig", "agrave",
    "amp", "aring", "atilde", "auml", "brvbar", "ccedil", "cedil", "cent", "copy", "curren", "deg",
    "divide", "eacute", "ecirc", "egrave", "eth", "euml", "frac12", "frac14", "frac34", "gt",
    "iacute", "icirc", "iexcl", "igrave", "iquest", "iuml", "laquo", "lt", "macr", "micro",
    "middot", "nbsp", "not", "ntilde", "oacute", "ocirc", "ograve", "ordf", "ordm", "oslash",
    "otilde", "ouml", "para", "plusmn", "pound", "quot", "raquo", "reg", "sect", "shy", "sup1",
    "sup2", "sup3", "szlig", "thorn", "times", "uacute", "ucirc", "ugrave", "uml", "uuml",
    "yacute", "yen", "yuml",
];

/// The value of the entity `&name;`.
fn named_entity(name: &str) -> Option<&'static str> {
    let table = &html_escape::NAMED_ENTITIES;
    table
        .binary_search_by(|(n, _)| (*n).cmp(name.as_bytes()))
        .ok()
        .map(|i| table[i].1)
}

/// The value of the semicolonless entity `&name`.
fn legacy_entity(name: &str) -> Option<&'static str> {
    LEGACY_ENTITIES
        .contains(&name)
        .then(|| named_entity(name))
        .flatten()
}

/// Python's `html.unescape`.
fn html_unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(pos) = rest.find('&') {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 1..];
        match charref(after) {
            Some((replacement, consumed)) => {
                out.push_str(&replacement);
                rest = &after[consumed..];
            }
            None => {
                out.push('&');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Python's `_charref` match and `_replace_charref` on the text right after an `&`: the
/// replacement and the number of bytes consumed, `None` where the `&` stays literal.
fn charref(after: &str) -> Option<(String, usize)> {
    let bytes = after.as_bytes();
    if bytes.first() == Some(&b'#') {
        let (radix, start) = match bytes.get(1) {
            Some(b'x' | b'X') => (16, 2),
            _ => (10, 1),
        };
        let digits = bytes[start..]
            .iter()
            .take_while(|b| (**b as char).is_digit(radix))
            .count();
        if digits == 0 {
            return None;
        }
        let end = start + digits;
        let num = bytes[start..end].iter().fold(0u64, |acc, b| {
            let d = u64::from((*b as char).to_digit(radix).unwrap_or(0));
            acc.saturating_mul(u64::from(radix)).saturating_add(d)
        });
        let consumed = end + usize::from(bytes.get(end) == Some(&b';'));
        return Some((numeric_charref(num), consumed));
    }
    let mut end = 0;
    let mut count = 0;
    for (i, c) in after.char_indices() {
        if count == 32 || matches!(c, '\t' | '\n' | '\x0c' | ' ' | '<' | '&' | '#' | ';') {
            break;
        }
        end = i + c.len_utf8();
        count += 1;
    }
    if count == 0 {
        return None;
    }
    let name = &after[..end];
    let semicolon = after[end..].starts_with(';');
    let consumed = end + usize::from(semicolon);
    let exact = if semicolon {
        named_entity(name)
    } else {
        legacy_entity(name)
    };
    if let Some(value) = exact {
        return Some((value.to_string(), consumed));
    }
    // The longest legacy entity that is a prefix (of at least 2 characters) of the name.
    let longest = if semicolon { count } else { count - 1 };
    (2..=longest).rev().find_map(|x| {
        let split = name.char_indices().nth(x).map_or(name.len(), |(i, _)| i);
        legacy_entity(&name[..split])
            .map(|value| (format!("{value}{}", &after[split..consumed]), consumed))
    })
}

/// Python's numeric character reference rules (`_invalid_charrefs`, `_invalid_codepoints`).
fn numeric_charref(num: u64) -> String {
    match num {
        0x00 => "\u{FFFD}".to_string(),
        0x0D => "\r".to_string(),
        0x80..=0x9F => CP1252_HIGH[(num - 0x80) as usize].to_string(),
        0xD800..=0xDFFF => "\u{FFFD}".to_string(),
        0x01..=0x08 | 0x0B | 0x0E..=0x1F | 0x7F | 0xFDD0..=0xFDEF => String::new(),
        n if n & 0xFFFE == 0xFFFE && n <= 0x10FFFF => String::new(),
        n => u32::try_from(n)
            .ok()
            .and_then(char::from_u32)
            .map_or_else(|| "\u{FFFD}".to_string(), String::from),
    }
}

/// ftfy's `unescape_html`: `&#?[0-9A-Za-z]{1,24};` replaced when it names an HTML5 entity (or
/// an upper-cased lower-case entity), or is a numeric reference Python fully decodes.
fn ftfy_unescape_html(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find('&') {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 1..];
        let hash = usize::from(after.starts_with('#'));
        let alnum = after[hash..]
            .bytes()
            .take_while(u8::is_ascii_alphanumeric)
            .count();
        let end = hash + alnum;
        if (1..=24).contains(&alnum) && after[end..].starts_with(';') {
            let entity = &rest[pos..pos + 1 + end + 1];
            out.push_str(&ftfy_entity(entity, &after[hash..end], hash == 1));
            rest = &after[end + 1..];
        } else {
            out.push('&');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// ftfy's replacement for one matched entity `&name;` / `&#name;`.
fn ftfy_entity(entity: &str, name: &str, numeric: bool) -> String {
    if numeric {
        let unescaped = html_unescape(entity);
        return if unescaped.contains(';') {
            entity.to_string()
        } else {
            unescaped
        };
    }
    if let Some(value) = named_entity(name) {
        return value.to_string();
    }
    let lower = name.to_ascii_lowercase();
    match named_entity(&lower) {
        Some(value) if lower.to_uppercase() == name && html_unescape(entity) == entity => {
            value.to_uppercase()
        }
        _ => entity.to_string(),
    }
}

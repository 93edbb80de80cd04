//! Command line: flags to one resolved configuration.
//!
//! [`args`] holds what was said (each option defined once, for flags and config keys alike);
//! [`resolve`] derives what it means, once: defaults < config file < command line < device,
//! into the [`crate::config::ResolvedConfig`] that is all later layers read.

pub mod args;
pub mod resolve;

use crate::config::files::read_capped;
use args::{Cli, Command, GenerateArgs};
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};
use std::ffi::OsString;
use std::path::Path;

pub use crate::config::{ResolvedConfig, UsageError};

/// What `main` should do after parsing.
pub enum Parsed {
    /// Help or version text, to be printed on stdout, exit 0.
    Info(String),
    /// A `generate` invocation with its options merged with the config file.
    Generate(Box<GenerateArgs>),
}

/// Parses the command line and merges the `--config` file under it.
pub fn parse(argv: impl IntoIterator<Item = OsString>) -> Result<Parsed, UsageError> {
    let mut command = Cli::command();
    let argv: Vec<OsString> = argv.into_iter().collect();
    refuse_non_utf8(&argv)?;
    let argv = expand_negations(&command, argv);
    let matches = match command.try_get_matches_from_mut(argv) {
        Ok(m) => m,
        Err(e) => return clap_outcome(e),
    };
    let cli = Cli::from_arg_matches(&matches).map_err(|e| UsageError::new(first_lines(&e)))?;
    match cli.command {
        Command::Generate(mut args) => {
            let sub = matches
                .subcommand_matches("generate")
                .expect("clap matched the generate subcommand");
            args.given = sub
                .ids()
                .filter(|id| sub.value_source(id.as_str()) == Some(ValueSource::CommandLine))
                .map(|id| id.as_str().to_string())
                .collect();
            if let Some(path) = args.config.clone() {
                let generate = command
                    .find_subcommand("generate")
                    .expect("the generate subcommand exists");
                let (options, keys) = merge_config_file(&path, &args.options, generate, |key| {
                    sub.value_source(key) == Some(ValueSource::CommandLine)
                })?;
                args.options = options;
                args.given.extend(keys);
            }
            Ok(Parsed::Generate(args))
        }
    }
}

/// Refuses any argument that is not UTF-8 (a path such as `$'o/bad\\xff'`) with one line
/// naming its flag: paths are recorded in the video's metadata and `--stats-json` as text.
fn refuse_non_utf8(argv: &[OsString]) -> Result<(), UsageError> {
    for (i, arg) in argv.iter().enumerate().skip(1) {
        if arg.to_str().is_some() {
            continue;
        }
        let lossy = arg.to_string_lossy();
        let flag = match lossy.split_once('=') {
            Some((flag, _)) if flag.starts_with("--") => flag.to_string(),
            _ => argv[i - 1]
                .to_str()
                .filter(|p| p.starts_with('-') && i > 1)
                .map_or_else(|| "an argument".to_string(), str::to_string),
        };
        return Err(UsageError::new(format!(
            "{flag} {lossy:?} is not valid UTF-8; vidgen needs UTF-8 paths and text: rename it or pass another path"
        )));
    }
    Ok(())
}

/// Rewrites `--no-X` into `--X=false` for every on/off option X, so each stays one clap argument.
fn expand_negations(command: &clap::Command, argv: Vec<OsString>) -> Vec<OsString> {
    let toggles: Vec<String> = command
        .get_subcommands()
        .flat_map(|s| s.get_arguments())
        .filter(|a| {
            a.get_num_args()
                .is_some_and(|n| n.min_values() == 0 && n.max_values() == 1)
        })
        .flat_map(|a| {
            let mut names: Vec<String> = a.get_long().into_iter().map(String::from).collect();
            names.extend(
                a.get_all_aliases()
                    .unwrap_or_default()
                    .into_iter()
                    .map(String::from),
            );
            names
        })
        .collect();
    let mut seen_separator = false;
    argv.into_iter()
        .map(|arg| {
            if seen_separator {
                return arg;
            }
            let Some(text) = arg.to_str() else { return arg };
            if text == "--" {
                seen_separator = true;
                return arg;
            }
            match text.strip_prefix("--no-") {
                Some(name) if toggles.iter().any(|t| t == name) => format!("--{name}=false").into(),
                _ => arg,
            }
        })
        .collect()
}

fn clap_outcome(e: clap::Error) -> Result<Parsed, UsageError> {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            Ok(Parsed::Info(e.render().to_string()))
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => Err(UsageError::new(
            "no command given: run `vidgen generate --prompt \"...\"`, or `vidgen --help`",
        )),
        _ => Err(UsageError::new(first_lines(&e))),
    }
}

/// Runs a config file's scalar value through the value parser of the flag of the same name
/// (arrays and tables are left to the type check after).
fn check_as_flag(generate: &clap::Command, key: &str, value: &toml::Value) -> Result<(), String> {
    let text = match value {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        _ => return Ok(()),
    };
    let Some(long) = generate
        .get_arguments()
        .find(|a| a.get_id() == key)
        .and_then(|a| a.get_long())
    else {
        return Ok(());
    };
    generate
        .clone()
        .try_get_matches_from(["generate".to_string(), format!("--{long}={text}")])
        .map(|_| ())
        .map_err(|e| {
            let text = e.render().to_string();
            let line = text.lines().next().unwrap_or("invalid value");
            line.trim_start_matches("error: ").to_string()
        })
}

/// Folds clap's multi-line error into one line: the problem plus clap's tip, if any.
fn first_lines(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let problem = lines
        .next()
        .unwrap_or("invalid arguments")
        .trim_start_matches("error: ")
        .to_string();
    let tip = lines.find_map(|l| {
        l.strip_prefix("tip: ").map(str::to_string).or_else(|| {
            l.starts_with("[possible values")
                .then(|| format!("use one of the {}", l.trim_matches(['[', ']'])))
        })
    });
    match tip {
        Some(tip) => format!("{problem}; {tip}"),
        None => format!("{problem}; see `vidgen generate --help`"),
    }
}

/// The most bytes `--config` may hold.
const MAX_CONFIG_FILE_BYTES: u64 = 16 << 20;

/// Lays a TOML config file under the command line: a key is taken from the file unless its
/// flag was given on the command line. Each value goes through its flag's own parser
/// (`generate`'s), so the file meets the same range checks as the command line.
fn merge_config_file(
    path: &Path,
    cli: &args::GenerateOptions,
    generate: &clap::Command,
    given_on_command_line: impl Fn(&str) -> bool,
) -> Result<(args::GenerateOptions, Vec<String>), UsageError> {
    let bytes = read_capped("config file", path, MAX_CONFIG_FILE_BYTES)
        .map_err(|e| UsageError::new(format!("{e:#}; pass a readable TOML file to --config")))?;
    merge_config_bytes(path, bytes, cli, generate, given_on_command_line)
}

/// [`merge_config_file`] on the file's bytes.
fn merge_config_bytes(
    path: &Path,
    bytes: Vec<u8>,
    cli: &args::GenerateOptions,
    generate: &clap::Command,
    given_on_command_line: impl Fn(&str) -> bool,
) -> Result<(args::GenerateOptions, Vec<String>), UsageError> {
    let text = String::from_utf8(bytes).map_err(|_| {
        UsageError::new(format!(
            "config file {} is not valid UTF-8; save it as UTF-8 TOML",
            path.display()
        ))
    })?;
    let table: toml::Table = toml::from_str(&text).map_err(|e| {
        // toml's messages can span lines ("invalid string\nexpected ..."): one line here.
        let msg = e
            .message()
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(", ");
        let line = e
            .span()
            .map(|s| format!(" (line {})", text[..s.start].lines().count().max(1)))
            .unwrap_or_default();
        UsageError::new(format!(
            "config file {} is not valid TOML{line}: {msg}; fix the syntax",
            path.display()
        ))
    })?;
    let serde_json::Value::Object(mut merged) =
        serde_json::to_value(cli).expect("options serialize to a JSON object")
    else {
        unreachable!("options serialize to a JSON object")
    };
    let defaults = merged.clone();
    let keys: Vec<String> = table.keys().cloned().collect();
    for (key, value) in table {
        if !merged.contains_key(&key) {
            return Err(UsageError::new(format!(
                "unknown key `{}` in config file {}; keys are the generate flags in snake_case (see `vidgen generate --help`)",
                key.escape_debug(),
                path.display()
            )));
        }
        check_as_flag(generate, &key, &value).map_err(|why| {
            UsageError::new(format!(
                "bad value for `{key}` in config file {}: {why}; use the same values as the --{} flag",
                path.display(),
                key.replace('_', "-")
            ))
        })?;
        let value = serde_json::to_value(value).expect("TOML values convert to JSON");
        // Check each key alone so a bad value is reported with its key.
        let mut single = defaults.clone();
        single.insert(key.clone(), value.clone());
        if let Err(e) =
            serde_json::from_value::<args::GenerateOptions>(single.into_iter().collect())
        {
            return Err(UsageError::new(format!(
                "bad value for `{key}` in config file {}: {e}; use the same values as the --{} flag",
                path.display(),
                key.replace('_', "-")
            )));
        }
        if !given_on_command_line(&key) {
            merged.insert(key, value);
        }
    }
    let options = serde_json::from_value(serde_json::Value::Object(merged))
        .map_err(|e| UsageError::new(format!("config file {}: {e}", path.display())))?;
    Ok((options, keys))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The options of a bare `generate` and its clap command, to merge config files under.
    fn bare() -> (args::GenerateOptions, clap::Command) {
        let Parsed::Generate(args) = parse(["vidgen", "generate"].map(OsString::from)).unwrap()
        else {
            panic!("not a generate command")
        };
        let command = Cli::command();
        let generate = command.find_subcommand("generate").unwrap().clone();
        (args.options, generate)
    }

    /// Mutated config files never panic the merge: each is merged or refused in one line.
    #[test]
    fn fuzzed_config_files_are_merged_or_refused_never_panic() {
        let (options, generate) = bare();
        let seeds: &[&[u8]] = &[
            b"seed = 3\nprompt = \"a fox\"\nguidance_scale = 5.0\nvae_cpu_offload = false\n",
            b"max_pinned_memory = \"2GiB\"\nprefetch_depth = 2\nnum_frames = 9\n# c\n",
            b"lazy_module_load = \"auto\"\noutput_type = \"png\"\ndevice = \"cpu\"\n",
        ];
        crate::fuzz::mutate(seeds, 2000, |bytes| {
            let merged = merge_config_bytes(
                Path::new("c.toml"),
                bytes.to_vec(),
                &options,
                &generate,
                |_| false,
            );
            if let Err(e) = merged {
                assert!(!e.to_string().contains('\n'), "not one line: {e}");
            }
        });
    }

    /// Inputs worth keeping: each is refused naming the problem.
    #[test]
    fn fuzz_regressions_in_config_files() {
        let (options, generate) = bare();
        let cases: &[(&[u8], &str)] = &[
            (b"guidance_scale = nan\n", "not a finite number"),
            (b"seed = -1\n", "`seed`"),
            (b"\xc3\xa9 = \xff\n", "not valid UTF-8"),
            // A syntax error right after a multi-byte character: the line is still counted.
            (b"prompt = \"\xc3\xa9\"\xc3\xa9\n", "line 1"),
            (b"num_frames = 4294967296\n", "`num_frames`"),
            // A quoted key holding a line break or a control character is shown escaped.
            (
                b"\"a\\nb\\u001b[31m\" = 1\n",
                "unknown key `a\\nb\\u{1b}[31m`",
            ),
            // toml's message for this spans two lines: folded into one.
            (
                b"seed = 3\nprompt = ompt = gu\n",
                "(line 2): invalid string, expected",
            ),
        ];
        for (bytes, needle) in cases {
            let e = merge_config_bytes(
                Path::new("c.toml"),
                bytes.to_vec(),
                &options,
                &generate,
                |_| false,
            )
            .unwrap_err();
            assert!(e.to_string().contains(needle), "{e}");
            assert!(!e.to_string().contains('\n'), "not one line: {e}");
        }
    }
}

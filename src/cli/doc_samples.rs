//! The code samples in the README and `docs/` stay true: every `almanac`
//! command line in a `sh` block parses with this CLI (so no sample names a
//! flag or subcommand that does not exist), and every `toml` block loads as
//! what it shows, an `almanac.toml` or a schedule file. (What the commands
//! do is tested where the behaviour lives; `tests/it/ops.rs` loads the
//! configuration sample and `tests/it/compose.rs` checks the Compose section.)

use std::path::{Path, PathBuf};

use clap::Parser as _;

use super::Cli;

/// `(file, first line, info string, body)` of every fenced block.
fn blocks() -> Vec<(PathBuf, usize, String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    let mut out = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let mut open: Option<(usize, String, String)> = None;
        for (n, line) in text.lines().enumerate() {
            match (&mut open, line.strip_prefix("```")) {
                (None, Some(info)) => open = Some((n + 1, info.trim().to_string(), String::new())),
                (Some(_), Some(_)) => {
                    let (at, info, body) = open.take().unwrap();
                    out.push((file.clone(), at, info, body));
                }
                (Some((_, _, body)), None) => {
                    body.push_str(line);
                    body.push('\n');
                }
                (None, None) => {}
            }
        }
        assert!(
            open.is_none(),
            "{}: a code block is not closed",
            file.display()
        );
    }
    out
}

/// Splits a shell line into words: single and double quotes, backslash
/// escapes outside single quotes; stops at an unquoted `#`.
fn words(line: &str) -> Vec<String> {
    let (mut out, mut word, mut any) = (Vec::new(), String::new(), false);
    let mut chars = line.chars();
    let (mut single, mut double) = (false, false);
    while let Some(c) = chars.next() {
        match c {
            '\'' if !double => {
                single = !single;
                any = true;
            }
            '"' if !single => {
                double = !double;
                any = true;
            }
            '\\' if !single => word.extend(chars.next()),
            '#' if !single && !double && word.is_empty() => break,
            c if c.is_whitespace() && !single && !double => {
                if any || !word.is_empty() {
                    out.push(std::mem::take(&mut word));
                    any = false;
                }
            }
            c => word.push(c),
        }
    }
    if any || !word.is_empty() {
        out.push(word);
    }
    out
}

/// The `almanac` command lines of a `sh` block, continuations joined.
fn commands(body: &str) -> Vec<Vec<String>> {
    let joined = body.replace("\\\n", " ");
    joined
        .lines()
        .map(words)
        .filter_map(|w| {
            let first = w.first()?;
            (first == "almanac" || first.ends_with("/almanac")).then_some(w)
        })
        .collect()
}

#[test]
fn every_almanac_command_in_the_docs_parses() {
    let mut checked = 0;
    for (file, line, info, body) in blocks() {
        if info != "sh" {
            continue;
        }
        for argv in commands(&body) {
            if let Err(err) = Cli::try_parse_from(&argv) {
                panic!(
                    "{}:{line}: `{}` does not parse:\n{err}",
                    file.display(),
                    argv.join(" ")
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 20, "only {checked} commands found in the docs");
}

#[test]
fn every_toml_block_in_the_docs_loads() {
    let mut checked = 0;
    for (file, line, info, body) in blocks() {
        if info != "toml" {
            continue;
        }
        let name = file.with_extension(format!("md:{line}.toml"));
        let as_config = crate::config::Config::parse(&name, &body);
        let as_schedules = crate::scheduler::spec::load_sources(&[(name.clone(), body.clone())]);
        assert!(
            as_config.is_ok() || as_schedules.is_ok(),
            "{}:{line}: loads neither as almanac.toml ({}) nor as a schedule file ({})",
            file.display(),
            as_config.unwrap_err(),
            as_schedules.unwrap_err()
        );
        checked += 1;
    }
    assert!(checked >= 2, "only {checked} toml blocks found in the docs");
}

#[test]
fn shell_words_split_as_sh_does() {
    assert_eq!(
        words(r#"almanac enqueue x --payload '{"to": "a b"}' --key k # note"#),
        [
            "almanac",
            "enqueue",
            "x",
            "--payload",
            r#"{"to": "a b"}"#,
            "--key",
            "k"
        ]
    );
    assert_eq!(words(r#"a "b c" d\ e ''"#), ["a", "b c", "d e", ""]);
}

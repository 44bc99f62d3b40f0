//! Which shape a chat template wants a message's `content` in, found as vLLM finds it
//! (`_detect_content_format` in vllm/entrypoints/chat_utils.py, read, not copied): a
//! template that loops over a message's content (`{% for part in message['content'] %}`)
//! gets a list of typed parts (`[{"type": "text", "text": …}]`, the "openai" format), any
//! other template a string (the text parts joined with newlines). Gemma 3, Llama 4 and the
//! vision models' templates loop; Llama 4's trims each text part where it keeps a string
//! whole, so the router renders the engine's text only in the engine's shape.
//!
//! The rules, on the template's syntax tree:
//! - the names that stand for the messages: `messages`, and every name `{% set %}` to one of
//!   them, filtered (`| selectattr(…)`), tested or sliced (`[1:]`), transitively;
//! - the names that stand for a message: the target of every `for` over one of those;
//! - the template loops over content when some `for` iterates over `m['content']` or
//!   `m.content` (filtered, tested or sliced) for such an `m`.
//!
//! Where vLLM's walk fails (a `set` of such a name to something not a plain name, a `for`
//! over the messages or their content into a tuple) it settles for the string format, and
//! so does this.

use std::collections::{HashMap, HashSet};

use minijinja::machinery::ast::{Expr, Stmt};

/// How a message's `content` reaches the template.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ContentFormat {
    /// A string: the text parts joined with newlines.
    String,
    /// A list of typed parts: `{"type": "text", "text": …}` for each text part.
    OpenAi,
}

/// vLLM's `--chat-template-content-format`: detected from the template, or given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ContentFormatOption {
    /// As the template wants it ([`detect`]).
    #[default]
    Auto,
    /// Always a string.
    String,
    /// Always a list of parts.
    OpenAi,
}

impl std::str::FromStr for ContentFormatOption {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ContentFormatOption::Auto),
            "string" => Ok(ContentFormatOption::String),
            "openai" => Ok(ContentFormatOption::OpenAi),
            _ => Err(format!(
                "chat template content format {s:?} is not auto, string or openai"
            )),
        }
    }
}

/// The format `source` wants; the string format when it does not parse.
pub fn detect(source: &str) -> ContentFormat {
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build();
    let Ok(syntax) = syntax else {
        return ContentFormat::String;
    };
    let Ok(root) = minijinja::machinery::parse(source, "chat", syntax) else {
        return ContentFormat::String;
    };
    let mut sets = Vec::new();
    let mut loops = Vec::new();
    collect(&root, &mut sets, &mut loops);
    if loops_over_content(&sets, &loops) {
        ContentFormat::OpenAi
    } else {
        ContentFormat::String
    }
}

/// Whether some loop runs over a message's content; false where vLLM's walk fails. Linear
/// in the template's `set`s and loops (a request may bring its own template: a walk of
/// every `set` for every name found took seconds for a megabyte of them).
fn loops_over_content(sets: &[(&Expr, &Expr)], loops: &[(&Expr, &Expr)]) -> bool {
    // The targets of the `set`s of each name.
    let mut set_from: HashMap<&str, Vec<&Expr>> = HashMap::new();
    for (target, value) in sets {
        if let Some(name) = name_of(value, None) {
            set_from.entry(name).or_default().push(target);
        }
    }
    // The messages' names, breadth first through the `set`s.
    let mut lists = vec!["messages"];
    let mut seen: HashSet<&str> = HashSet::from(["messages"]);
    let mut next = 0;
    while let Some(&name) = lists.get(next) {
        next += 1;
        for target in set_from.get(name).into_iter().flatten() {
            let Expr::Var(var) = target else {
                return false;
            };
            if seen.insert(var.id) {
                lists.push(var.id);
            }
        }
    }
    // A message's names: the targets of loops over the messages.
    let mut items = HashSet::new();
    for (target, iter) in loops {
        if name_of(iter, None).is_some_and(|name| seen.contains(name)) {
            let Expr::Var(var) = target else {
                return false;
            };
            items.insert(var.id);
        }
    }
    // The first loop over a message's content decides.
    for (target, iter) in loops {
        if name_of(iter, Some("content")).is_some_and(|name| items.contains(name)) {
            return matches!(target, Expr::Var(_));
        }
    }
    false
}

/// The name `expr` stands for: `name` (or, with a key, `name[key]` / `name.key`), possibly
/// filtered, tested or sliced (vLLM's `_is_var_or_elems_access`).
fn name_of<'e>(expr: &Expr<'e>, key: Option<&str>) -> Option<&'e str> {
    match expr {
        Expr::Filter(f) => name_of(f.expr.as_ref()?, key),
        Expr::Test(t) => name_of(&t.expr, key),
        Expr::Slice(s) => name_of(&s.expr, key),
        _ => match key {
            None => var_name(expr),
            Some(key) => match expr {
                Expr::GetItem(item)
                    if matches!(&item.subscript_expr, Expr::Const(c)
                        if c.value.as_str() == Some(key)) =>
                {
                    var_name(&item.expr)
                }
                Expr::GetAttr(attr) if attr.name == key => var_name(&attr.expr),
                _ => None,
            },
        },
    }
}

fn var_name<'e>(expr: &Expr<'e>) -> Option<&'e str> {
    match expr {
        Expr::Var(v) => Some(v.id),
        _ => None,
    }
}

/// Every `{% set name = value %}` as (target, value) and every `for` as (target, iter), in
/// document order.
fn collect<'t, 's>(
    stmt: &'t Stmt<'s>,
    sets: &mut Vec<(&'t Expr<'s>, &'t Expr<'s>)>,
    loops: &mut Vec<(&'t Expr<'s>, &'t Expr<'s>)>,
) {
    let all = |body: &'t [Stmt<'s>], sets: &mut Vec<_>, loops: &mut Vec<_>| {
        for s in body {
            collect(s, sets, loops);
        }
    };
    match stmt {
        Stmt::Template(t) => all(&t.children, sets, loops),
        Stmt::ForLoop(f) => {
            loops.push((&f.target, &f.iter));
            all(&f.body, sets, loops);
            all(&f.else_body, sets, loops);
        }
        Stmt::IfCond(i) => {
            all(&i.true_body, sets, loops);
            all(&i.false_body, sets, loops);
        }
        Stmt::WithBlock(w) => all(&w.body, sets, loops),
        Stmt::Set(s) => sets.push((&s.target, &s.expr)),
        Stmt::SetBlock(s) => all(&s.body, sets, loops),
        Stmt::AutoEscape(a) => all(&a.body, sets, loops),
        Stmt::FilterBlock(f) => all(&f.body, sets, loops),
        Stmt::Macro(m) => all(&m.body, sets, loops),
        Stmt::CallBlock(c) => all(&c.macro_decl.body, sets, loops),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chain of 50,000 `set`s (a request may bring its own template) is walked once:
    /// the format is found through all of them.
    #[test]
    fn a_long_chain_of_sets_is_walked_once() {
        let n = 50_000;
        let mut t = String::from("{% set a0 = messages %}");
        for i in 1..n {
            t.push_str(&format!("{{% set a{i} = a{} %}}", i - 1));
        }
        t.push_str(&format!(
            "{{% for m in a{} %}}{{% for p in m.content %}}{{% endfor %}}{{% endfor %}}",
            n - 1
        ));
        assert_eq!(detect(&t), ContentFormat::OpenAi);
    }

    #[test]
    fn templates_that_loop_over_content_want_parts() {
        let openai = [
            // Llama 4 / Llama 3.2 Vision's shape.
            "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'text' %}{{ content['text'] | trim }}{% endif %}{% endfor %}{% endif %}{% endfor %}",
            // Gemma 3's: the loop runs over a slice set to a name.
            "{%- if messages[0]['role'] == 'system' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}{%- for item in message['content'] -%}{{ item['text'] }}{%- endfor -%}{%- endfor -%}",
            // Attribute access, a filtered list, a nested set, a loop inside a macro.
            "{% set ms = messages | selectattr('role', 'ne', 'tool') %}{% set ms2 = ms %}{% macro show(x) %}{% for m in ms2 %}{% for p in m.content | list %}{{ p.text }}{% endfor %}{% endfor %}{% endmacro %}{{ show(1) }}",
        ];
        for t in openai {
            assert_eq!(detect(t), ContentFormat::OpenAi, "{t}");
        }
        let string = [
            // Llama 3.1 / Qwen3 / DeepSeek: content used whole.
            "{% for message in messages %}{{ message['content'] | trim }}{% endfor %}",
            "{%- for message in messages %}{%- if message.content is string %}{%- set content = message.content %}{%- endif %}{{ content }}{%- endfor %}",
            // A loop over something else's content, or over a message picked by index.
            "{% for doc in documents %}{% for c in doc.content %}{{ c }}{% endfor %}{% endfor %}",
            "{% for c in messages[0]['content'] %}{{ c }}{% endfor %}",
            // vLLM's walk fails on a tuple target over the messages: string.
            "{% for i, m in messages | items %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}",
            // Not a template.
            "{% for %}",
        ];
        for t in string {
            assert_eq!(detect(t), ContentFormat::String, "{t}");
        }
    }
}

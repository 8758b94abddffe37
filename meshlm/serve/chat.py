"""Chat messages to one prompt string, through a Jinja chat template.

The renderer lives in `meshlm.data.chat_template`, below both serving and training, so that a model
is fine-tuned on conversations rendered exactly as it is later prompted; this module keeps the
serving-side names.

    template = ChatTemplate.from_source(model.chat_template, bos_token="<s>", eos_token="</s>")
    prompt = template.render([{"role": "user", "content": "Hi!"}])
"""

from meshlm.data.chat_template import DEFAULT_STOP, DEFAULT_TEMPLATE, ChatTemplate, ChatTemplateError

__all__ = ["DEFAULT_STOP", "DEFAULT_TEMPLATE", "ChatTemplate", "ChatTemplateError"]
